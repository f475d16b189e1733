"""``compress bench serve --model EXPORT [--hf DIR] [--peers ours,ours-serial,llamacpp]
[--workload random|shared-prefix|long-prompt] [--concurrency 1 4 16 | --rate R ...]
--num-prompts N --seed S --out results.json``

Starts every peer, warms each up with one short request, then sends each the same
seeded workload at every load (fresh prompts per load and round, peers interleaved), and
stops them; then prints one table (TTFT / TPOT / ITL / E2E p50/p90/p99, requests/s,
output tokens/s, output throughput against ``ours-serial`` and ``llamacpp``) and writes
every figure and setting as JSON. ``--merge`` reads earlier JSON files and prints their
rows as one table (runs split to stay short)."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from compress.bench.serve import kv_sampler
from compress.bench.serve import peers as peers_mod
from compress.bench.serve import report, run, workload
from compress.bench.serve.client import http_json
from compress.errors import UserError
from compress.cli_args import positive_int

DEFAULT_PEERS = "ours,ours-serial,llamacpp"


def _pair(values: list[int], name: str) -> tuple[int, int]:
    if len(values) != 2:
        raise UserError(f"{name}: give two numbers, LOW HIGH")
    return values[0], values[1]


def server_encoder(base_url: str):
    """Text -> ids through a server's ``POST /tokenize`` (vLLM's body, else llama.cpp's)."""
    def encode(text: str) -> list[int]:
        for body in ({"prompt": text, "add_special_tokens": False}, {"content": text, "add_special": False}):
            status, answer = http_json(base_url.rstrip("/") + "/tokenize", body, timeout=120.0)
            if status == 200 and isinstance(answer, dict) and isinstance(answer.get("tokens"), list):
                return [int(t) for t in answer["tokens"]]
        raise UserError(f"{base_url}/tokenize did not tokenize the prompt text, and the model has no "
                        "tokenizer.json to do it here")
    return encode


def _settings(args) -> workload.WorkloadSettings:
    return workload.WorkloadSettings(
        prompt_len=_pair(args.prompt_len, "--prompt-len"), output_len=_pair(args.output_len, "--output-len"),
        prefix_len=args.prefix_len, suffix_len=_pair(args.suffix_len, "--suffix-len"), running=args.running,
        running_output_len=args.running_output_len, long_prompt_len=args.long_prompt_len)


def _loads(args) -> list[tuple[str, dict]]:
    if args.workload == "long-prompt":
        return [("long-prompt", {})]
    if args.rate:
        cap = f", max {args.max_concurrency}" if args.max_concurrency else ""
        return [(f"rate {r:g}/s{cap}", {"rate": r, "max_concurrency": args.max_concurrency}) for r in args.rate]
    return [(f"c={c}", {"concurrency": c}) for c in args.concurrency]


def _run_load(target: run.Target, requests, load: dict, args, seed: int) -> list:
    if args.workload == "long-prompt":
        return asyncio.run(run.run_long_prompt(target, requests, args.long_after))
    if "rate" in load:
        arrivals = workload.poisson_arrivals(len(requests), load["rate"], seed)
        return asyncio.run(run.run_arrivals(target, requests, arrivals, load["max_concurrency"]))
    return asyncio.run(run.run_concurrency(target, requests, load["concurrency"]))


def _gguf_for(args, threads: int, log) -> str | None:
    if args.gguf:
        return args.gguf
    if not args.hf:
        return None
    from compress.bench import llamacpp_bench
    from compress.bench.llamacpp import default_dir, load_tools

    tools = load_tools(args.llamacpp_dir)
    cache = Path(args.llamacpp_dir or default_dir()) / "gguf" / llamacpp_bench.source_key(args.hf)
    return str(llamacpp_bench.make_gguf(tools, args.hf, args.gguf_type, cache, threads, log))


def _peer_list(args) -> list[tuple[str, str | None]]:
    """(name, url or None) in run order: the named peers, then ``--url`` ones."""
    names = [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else []
    urls = []
    for item in args.url:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith("http"):
            raise UserError(f"--url {item!r}: expected NAME=http://host:port")
        urls.append((name, url))
    out = [(n, None) for n in names if n not in dict(urls)] + urls
    for n, url in out:
        if url is None and n not in peers_mod.PEERS:
            raise UserError(f"--peers: unknown peer {n!r}; choose among {', '.join(peers_mod.PEERS)} "
                            f"or give --url {n}=URL")
    if not out:
        raise UserError("no peers: give --peers and/or --url NAME=URL")
    return out


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through the peers' `with`: their servers are stopped


def _workload_seed(seed: int, load_index: int, round_index: int) -> int:
    """Each load and round gets its own prompts (the same for every peer): a prompt
    that a server saw in an earlier load could be answered from its prefix cache."""
    return seed * 1_000_003 + load_index * 1_009 + round_index


def sampling_fields(args) -> dict:
    """The request fields of --temperature / --top-p (none when greedy, the default).
    UserError: a temperature below 0, a top_p outside (0, 1], or a top_p without a
    temperature (greedy requests ignore it)."""
    temperature, top_p = getattr(args, "temperature", 0.0), getattr(args, "top_p", 1.0)
    if temperature < 0 or not 0 < top_p <= 1:
        raise UserError(f"compress bench serve: --temperature must be >= 0 and --top-p in (0, 1], got "
                        f"{temperature} and {top_p}")
    if not temperature:
        if top_p != 1.0:
            raise UserError("compress bench serve: --top-p needs --temperature above 0 (greedy requests ignore it)")
        return {}
    return {"temperature": temperature, "top_p": top_p}


def _start_peers(stack: ExitStack, peer_list, peer_settings, log_dir: Path, args, log) -> list:
    """Every peer started and warmed up: [(name, RunningPeer, Target)]."""
    out = []
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for name, url in peer_list:
        # a running server named like a peer kind (e.g. ours) gets that kind's request fields
        known = peers_mod.PEERS.get(name)
        peer = (peers_mod.RunningPeer(name, None, None, url, known.body if known else None) if url else
                peers_mod.RunningPeer.from_settings(name, peer_settings, log_dir))
        log(f"# {name}: starting {_describe(peer)}" + (f" (log {peer.log_path})" if peer.log_path else ""))
        stack.enter_context(peer)
        body = {**(peer.body or {}), **sampling_fields(args)}
        out.append((name, peer, run.Target(peer.base_url, run.served_model(peer.base_url, headers) or "default",
                                           headers, extra_body=body, timeout=args.request_timeout)))
    return out


def _describe(peer) -> str:
    return (" ".join(peer.command) if peer.command else peer.base_url) + (
        f"  (requests add {json.dumps(peer.body)})" if peer.body else "")


def run_bench(args, log=print) -> dict:
    """Start every peer; for each load, ``rounds`` times, send each peer the same fresh
    workload in turn (the order reversed every other round, so that a drift of the
    machine's speed falls on all peers alike); one row per peer and load."""
    settings = _settings(args)
    peer_list = _peer_list(args)
    if args.rounds < 1:
        raise UserError(f"--rounds {args.rounds}: must be at least 1")
    texts = workload.read_texts(args.text)
    encode = workload.local_encoder(args.model) if args.model else None
    gguf = _gguf_for(args, args.threads, log) if any(n == "llamacpp" and u is None for n, u in peer_list) else None
    peer_settings = peers_mod.PeerSettings(model=args.model, threads=args.threads, slots=args.slots,
                                           ctx_per_slot=args.ctx_per_slot, gguf=gguf, ours_args=args.ours_arg,
                                           llamacpp_args=args.llamacpp_arg, llamacpp_dir=args.llamacpp_dir)
    log_dir = Path(args.log_dir) if args.log_dir else Path(args.out or "bench-serve.json").with_suffix(".logs")
    rows, seeds = [], []
    with ExitStack() as stack:
        peers = _start_peers(stack, peer_list, peer_settings, log_dir, args, log)
        # no local tokenizer: the first server tokenizes, and every peer gets those ids
        corpus = workload.corpus_ids(texts, encode or server_encoder(peers[0][2].base_url))
        warm_prompt = tuple(corpus[-16:])   # not a prefix of any workload prompt but by chance
        for name, peer, target in peers:
            warm = asyncio.run(run.warm_up(target, warm_prompt))
            if not warm.ok:
                raise peers_mod.PeerError(f"peer {name}: the warm-up request failed: {warm.error}"
                                          + (f" (log {peer.log_path})" if peer.log_path else ""))
        for load_index, (label, load) in enumerate(_loads(args)):
            results = {name: [] for name, _, _ in peers}
            kv = {name: [] for name, _, _ in peers}
            for round_index in range(args.rounds):
                seed = _workload_seed(args.seed, load_index, round_index)
                seeds.append(seed)
                requests = workload.build_workload(args.workload, corpus, args.num_prompts, seed, settings)
                order = peers if round_index % 2 == 0 else peers[::-1]
                for name, _, target in order:
                    t0 = time.perf_counter()
                    with kv_sampler.KVSampler(target.base_url, target.headers) as sampler:
                        got = _run_load(target, requests, load, args, seed)
                    results[name].append(got)
                    kv[name].append(kv_sampler.summarize(sampler.samples))
                    s = report.summarize(got)
                    log(f"# {name} {label} round {round_index + 1}/{args.rounds}: {s['completed']} ok, "
                        f"{s['failed']} failed, {s['output_throughput']:.1f} output tok/s, TTFT p50 "
                        f"{s['ttft_ms']['p50']:.0f} ms ({time.perf_counter() - t0:.0f} s)")
                    for err in s["errors"]:
                        log(f"#   error: {err}")
            for name, _, _ in peers:
                row = {"peer": name, "workload": args.workload, "load": label, **load,
                       **report.summarize_rounds(results[name])}
                if args.workload == "long-prompt":
                    row["long_prompt"] = report.long_prompt_stall(results[name])
                row["kv_reserve"] = kv_sampler.merge(kv[name])
                rows.append(row)
        commands = {name: _describe(peer) for name, peer, _ in peers}
    report.add_ratios(rows)
    return {"rows": rows,
            "settings": {"model": args.model, "hf": args.hf, "gguf": gguf, "threads": args.threads,
                         "workload": args.workload, "num_prompts": args.num_prompts, "rounds": args.rounds,
                         "seed": args.seed, "workload_seeds": seeds, "workload_settings": vars(settings),
                         "text": [str(t) for t in (args.text or workload.DEFAULT_TEXT_FILES)],
                         "slots": args.slots, "ctx_per_slot": args.ctx_per_slot, "peer_commands": commands,
                         "argv": sys.argv[1:]},
            "cpu": _cpu()}


def _cpu() -> dict:
    from compress.bench.cpu_info import describe_cpu

    return describe_cpu()


def render(result: dict) -> str:
    text = report.markdown_table(result["rows"])
    stall = report.long_prompt_table(result["rows"])
    kv = report.kv_reserve_lines(result["rows"])
    return text + ("\n\n" + stall if stall else "") + ("\n\n" + kv if kv else "")


def main(args) -> int:
    if args.merge:
        rows = []
        for f in args.merge:
            rows += [{k: v for k, v in r.items() if not k.startswith("vs_")} for r in json.loads(Path(f).read_text())["rows"]]
        report.add_ratios(rows)
        result = {"rows": rows, "merged_from": [str(f) for f in args.merge]}
    else:
        if not args.model and not args.url:
            raise UserError("--model EXPORT is required (or --url NAME=URL for servers already running)")
        sampling_fields(args)   # its errors before any server starts
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
        try:
            result = run_bench(args)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
    print(render(result))
    if args.out:
        from compress.io.files import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=1, default=str))
        print(f"# written: {args.out}")
    failed = sum(r["failed"] for r in result["rows"])
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="our export (what `compress serve` loads; its tokenizer.json makes the prompts)")
    p.add_argument("--hf", help="the dense HF source of the export: llama-server's GGUF is converted from it")
    p.add_argument("--gguf", help="llama-server's weights as a GGUF file (instead of --hf)")
    p.add_argument("--gguf-type", default="q4_0", choices=["q4_0", "q8_0", "f16"],
                   help="GGUF type made from --hf (q4_0 beside an int4 export, q8_0 beside int8)")
    p.add_argument("--peers", default=DEFAULT_PEERS,
                   help=f"servers to start, comma-separated, among {', '.join(peers_mod.PEERS)} "
                        f"(default {DEFAULT_PEERS}); empty with --url only")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="a server already running (repeatable), e.g. ours=http://127.0.0.1:8000")
    p.add_argument("--workload", default="random", choices=workload.WORKLOADS)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                      help="fixed concurrencies: all requests ready at once, at most C in flight (default 1 4 16)")
    load.add_argument("--rate", type=float, nargs="+", help="Poisson arrival rates, requests/s (instead of "
                                                            "--concurrency)")
    p.add_argument("--max-concurrency", type=int, help="with --rate: at most this many in flight")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per load (random, shared-prefix)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads (each load and round draws its "
                                                        "own prompts from it, the same for every peer)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each load per peer, interleaved between the peers; latencies pooled, "
                        "throughput the median run's")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--threads", type=positive_int, default=2, help="threads of every peer")
    p.add_argument("--text", nargs="+", help="prompt text files (default: the repository's data/pydoc text)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("LOW", "HIGH"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("LOW", "HIGH"))
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: common prefix tokens")
    p.add_argument("--suffix-len", type=int, nargs=2, default=[32, 128], metavar=("LOW", "HIGH"),
                   help="shared-prefix: each request's own tokens after the prefix")
    p.add_argument("--running", type=int, default=6, help="long-prompt: requests decoding when the long one comes")
    p.add_argument("--running-output-len", type=int, default=256, help="long-prompt: tokens each running request makes")
    p.add_argument("--long-prompt-len", type=int, default=2000)
    p.add_argument("--long-after", type=float, default=1.0,
                   help="long-prompt: seconds after the running requests' first tokens that the long prompt comes")
    p.add_argument("--slots", type=int, default=16, help="llama-server parallel slots (-np)")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="llama-server context per slot (-c is slots x this)")
    p.add_argument("--ours-arg", action="append", default=[], help="extra `compress serve` argument (repeatable), e.g. --ours-arg=--no-prefix-caching")
    p.add_argument("--llamacpp-arg", action="append", default=[], help="extra llama-server argument (repeatable), e.g. --llamacpp-arg=--no-cache-prompt")
    p.add_argument("--llamacpp-dir", help="where `compress bench llamacpp` keeps its build (default: its cache)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy, as the targets are measured)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass of every request")
    p.add_argument("--api-key", help="bearer token sent to every peer")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--log-dir", help="servers' logs (default: beside --out, <out>.logs/)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print earlier results files as one table (runs "
                                                             "nothing)")
