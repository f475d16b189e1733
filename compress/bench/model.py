"""``compress bench model PATH``: prefill and decode tokens/s of a checkpoint on the
compress runtime, at batch 1 and 16, beside llama.cpp at its best -- its own native
``llama-bench`` / ``llama-batched-bench`` built for this CPU (``compress bench
llamacpp``) on Q4_0 / Q8_0 / F16 GGUFs made from the dense HF source with its converter
and ``llama-quantize`` (:mod:`compress.bench.llamacpp_bench`) -- and transformers
``generate()``, with the bandwidth limit (DRAM read GB/s / weight bytes per token).
Engines alternate round by round (medians over ``--reps`` rounds), all on the same
threads; the output and the JSON name the CPU (model and ISA flags)."""
from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from compress.bench.bandwidth import read_bandwidth
from compress.bench.cpu_info import cpu_line, describe_cpu
from compress.errors import UserError
from compress.io.files import atomic_write_text
from compress.cli_args import positive_int


@dataclass
class ModelRecord:
    engine: str
    scheme: str
    batch: int
    threads: int
    prompt_len: int
    new_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes_per_token: int
    bandwidth_limit_tok_s: float
    kv_cache: str = ""  # the KV cache's element type (llama.cpp: its default, f16)
    prefill_rounds: list[float] = field(default_factory=list)  # every round's figure, in order (the
    decode_rounds: list[float] = field(default_factory=list)   # medians above are of these)


def _median(v):
    return statistics.median(v)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (batch, prompt_len), generator=g).tolist()


def _streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer except the embedding table
    (one row per token) and rotary / cache buffers; a module with ``read_bytes()`` (a
    runtime layer whose kernel reads a load-time form of its tensors) says it itself."""
    skip = ("embed", "cache", "rotary", "inv_freq", "rope_")
    total = 0
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "read_bytes"):
            total += mod.read_bytes()
            continue
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if not any(k in f"{mod_name}.{name}" for k in skip):
                total += t.numel() * t.element_size()
    return total


# Every engine below is prepared first (loaded, warmed up) and returns ``one_round()``
# -> ``(prefill tok/s, decode tok/s)``; ``run`` then calls all of them in turn, round
# after round, so that the machine's drift over minutes hits every engine alike.

# ---------------------------------------------------------------- compress runtime
def compress_runner(llm, batch: int, prompt_len: int, new_tokens: int):
    """Rounds of ``llm.generate`` of ``batch`` prompts. The engine's token budget must
    hold the whole batch's prompts (``LLM(max_num_batched_tokens=...)``), so that they
    are prefilled in one step and decoded together after it, as a static batch: prefill
    tok/s is every prompt token over the time to the first tokens, decode tok/s the
    tokens after them over the time from the first tokens to the end. Rounds repeat
    their prompts: the engine must not cache prefixes (``enable_prefix_caching=False``)."""
    from compress.runtime import SamplingParams

    prompts = _prompts(batch, prompt_len, llm.config.vocab_size)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    def one_round():
        outs = llm.generate(prompts, params)
        start = min(o.metrics["first_scheduled_time"] for o in outs)
        first = max(o.metrics["first_token_time"] for o in outs)
        end = max(o.metrics["finish_time"] for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        decoded = sum(len(o.token_ids) - 1 for o in outs)
        return prompt_tokens / (first - start), decoded / max(end - first, 1e-9)
    return one_round


# ---------------------------------------------------------------- transformers
def transformers_runner(model, batch: int, prompt_len: int, new_tokens: int):
    ids = torch.tensor(_prompts(batch, prompt_len, model.config.vocab_size), device=model.device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def gen(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(2)

    def one_round():
        t1 = gen(1)
        tn = gen(new_tokens)
        return batch * prompt_len / t1, batch * (new_tokens - 1) / max(tn - t1, 1e-9)
    return one_round


# ---------------------------------------------------------------- command
def run(args, log=print) -> dict:
    from pathlib import Path

    for path in [*args.paths, *([args.hf] if args.hf else [])]:   # before any measuring
        if not Path(path, "config.json").is_file():
            raise UserError(f"bench model: {path}: " + ("no config.json: not a model directory" if Path(path).is_dir()
                                                        else "no such model directory"))
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    llamacpp_tools = None
    if args.hf and "llamacpp" in args.engines:  # missing tools: say so before any work
        from compress.bench.llamacpp import load_tools
        llamacpp_tools = load_tools(args.llamacpp_dir)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("bench model --device cuda: torch sees no CUDA device")
    if device == "cuda" and "llamacpp" in args.engines:
        log("# llama.cpp left out: --device cuda runs our runtime and transformers on the GPU only")
        args.engines = [e for e in args.engines if e != "llamacpp"]
    cpu = describe_cpu()
    log(f"# {cpu_line(cpu)}")
    if device == "cuda":  # the limit: weights streamed from HBM at a device copy's rate (read + written)
        from compress.bench.cuda import measure_copy_bandwidth
        gbps = measure_copy_bandwidth("cuda") / 1e9
        bw = {"best_gbps": gbps, "median_gbps": gbps, "device": torch.cuda.get_device_name()}
        log(f"# {bw['device']}: device copy {gbps:.0f} GB/s (read + written)")
    else:
        bw = read_bandwidth(int(args.bandwidth_mib) << 20)
        gbps = bw["best_gbps"]
        log(f"# threads={threads} DRAM read bandwidth: best {gbps:.1f} GB/s (median {bw['median_gbps']:.1f})")
    runners = []   # (engine, scheme, batch, weight bytes per token, one_round, kv cache type)
    engines = set(args.engines)
    if "compress" in engines:
        from compress.runtime import LLM
        cuda_graphs = args.cuda_graphs if device == "cuda" else ["on"]
        for path in args.paths:
            for kv, act, graphs in itertools.product(args.kv_cache_dtypes, args.w4_activations, cuda_graphs):
                llm = LLM(path, dtype=args.dtype, kernels="native", threads=threads, max_batch_size=max(args.batch),
                          device=device, cuda_graphs=graphs == "on",
                          kv_cache_dtype=None if kv == "model" else kv, w4_activations=act,
                          max_num_batched_tokens=max(args.batch) * args.prompt_len,
                          kv_cache_tokens=max(args.batch) * (args.prompt_len + args.new_tokens + 16),
                          enable_prefix_caching=False)  # rounds repeat their prompts
                if act != args.w4_activations[0] and llm.w4_activations is None:
                    continue   # no int4 layers: the activation choice changes nothing
                scheme = "+".join(sorted({getattr(mod, "scheme", None) for mod in llm.model.modules()} - {None}))
                if llm.w4_activations == "int8":  # int4 layers on the fast path: named apart
                    scheme += "/int8-act"
                if device == "cuda" and graphs == "off":
                    scheme += "/no-graphs"
                kv_name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
                           torch.int8: "i8"}[llm.kv_cache_dtype]
                for b in args.batch:
                    runners.append(("compress", scheme, b, _streamed_bytes(llm.model),
                                    compress_runner(llm, b, args.prompt_len, args.new_tokens), kv_name))
    hf = args.hf
    need_hf = sorted(engines & {"llamacpp", "transformers"})
    if need_hf and not hf:
        log(f"# skipped {' and '.join(need_hf)}: they run the dense source model, pass it with --hf DIR")
    if hf and "transformers" in engines:
        from transformers import AutoModelForCausalLM
        for dt in args.hf_dtypes:
            tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dt]
            model = AutoModelForCausalLM.from_pretrained(hf, dtype=tdtype).to(device).eval()
            torch.set_num_threads(threads)
            for b in args.batch:
                runners.append(("transformers", dt, b, _streamed_bytes(model),
                                transformers_runner(model, b, args.prompt_len, args.new_tokens),
                                {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dt]))
    llamacpp_info = None
    if hf and "llamacpp" in engines:
        llamacpp_info = _add_llamacpp_runners(runners, llamacpp_tools, args, hf, threads, log)
    rounds: list[list[tuple[float, float]]] = [[] for _ in runners]
    for r in range(args.reps):
        log(f"# round {r + 1}/{args.reps}: every engine in turn")
        for i, runner in enumerate(runners):
            rounds[i].append(runner[4]())
    records: list[ModelRecord] = []
    for (engine, scheme, batch, nbytes, _, kv), res in zip(runners, rounds):
        limit = gbps * 1e9 / nbytes * batch if nbytes else float("nan")
        prefills, decodes = [p for p, _ in res], [d for _, d in res]
        rec = ModelRecord(engine, scheme, batch, threads, args.prompt_len, args.new_tokens, _median(prefills),
                          _median(decodes), nbytes, limit, kv, prefills, decodes)
        records.append(rec)
        log(f"{engine:<13} {scheme:<14} kv {kv:<4} batch {batch:>3}  prefill {rec.prefill_tok_s:8.1f} tok/s  "
            f"decode {rec.decode_tok_s:7.1f} tok/s [{min(decodes):.1f}-{max(decodes):.1f}]  "
            f"(limit {limit:7.1f} tok/s, {nbytes / 1e6:6.1f} MB/token)")
    comparison = compare(records)
    for line in comparison_lines(comparison):
        log(line)
    return {"cpu": cpu, "device": device, "threads": threads, "bandwidth": bw, "llamacpp": llamacpp_info,
            "records": [asdict(r) for r in records], "comparison": comparison}


def _add_llamacpp_runners(runners: list, tools, args, hf: str, threads: int, log) -> dict:
    """llama.cpp's native ``tools`` (``compress bench llamacpp`` builds them) on GGUFs
    made from ``hf``: one runner per GGUF type and batch. Returns what the JSON records
    of the build (version, cmake arguments, the GGUF folder)."""
    from compress.bench import llamacpp_bench
    from compress.bench.llamacpp import default_dir

    cache = Path(args.gguf_dir) if args.gguf_dir else (
        Path(args.llamacpp_dir or default_dir()) / "gguf" / llamacpp_bench.source_key(hf))
    for qt in args.gguf_types:
        gguf = llamacpp_bench.make_gguf(tools, hf, qt, cache, threads, log)
        nbytes = llamacpp_bench.gguf_streamed_bytes(tools, gguf)
        log(f"# llama.cpp {qt}: {gguf}")
        for b in args.batch:
            runners.append(("llama.cpp", qt, b, nbytes,
                            llamacpp_bench.llamacpp_runner(tools, gguf, b, args.prompt_len, args.new_tokens, threads),
                            "f16"))
    return {"llama_cpp_python": tools.version, "cmake_args": tools.cmake_args, "gguf_dir": str(cache),
            "tools": tools.tools}


def _peer_gguf(scheme: str) -> str | None:
    """The llama.cpp GGUF type of the same bit width as a compress scheme."""
    if "w4a16" in scheme:
        return "q4_0"
    if "w8a8" in scheme or "llm_int8" in scheme:
        return "q8_0"
    return None


def round_ratios(ours: list[float], theirs: list[float], ours_median: float,
                 theirs_median: float) -> tuple[float, float, float]:
    """(median, lowest, highest) of ours / theirs taken round by round (both ran in each
    round, so drift of the machine between rounds cancels); the ratio of the medians
    when the rounds do not pair up."""
    if ours and len(ours) == len(theirs):
        ratios = [a / b for a, b in zip(ours, theirs)]
        return _median(ratios), min(ratios), max(ratios)
    r = ours_median / theirs_median
    return r, r, r


def compare(records: list[ModelRecord]) -> list[dict]:
    """Each compress record over every baseline record at the same batch (llama.cpp: the
    GGUF type of the same bit width, int4 -> q4_0, int8 -> q8_0; transformers: every
    dtype): decode and prefill ratios (medians of the per-round ratios, with their
    range), and each side's decode as a share of its bandwidth limit."""
    out = []
    for r in records:
        if r.engine != "compress":
            continue
        for o in records:
            if o.batch != r.batch or not ((o.engine == "llama.cpp" and o.scheme == _peer_gguf(r.scheme))
                                          or o.engine == "transformers"):
                continue
            dec = round_ratios(r.decode_rounds, o.decode_rounds, r.decode_tok_s, o.decode_tok_s)
            pre = round_ratios(r.prefill_rounds, o.prefill_rounds, r.prefill_tok_s, o.prefill_tok_s)
            out.append({"scheme": r.scheme, "kv_cache": r.kv_cache, "batch": r.batch,
                        "baseline": f"{o.engine} {o.scheme}",
                        "decode_ratio": dec[0], "decode_ratio_range": list(dec[1:]),
                        "prefill_ratio": pre[0], "prefill_ratio_range": list(pre[1:]),
                        "decode_of_limit": r.decode_tok_s / r.bandwidth_limit_tok_s,
                        "baseline_decode_of_limit": o.decode_tok_s / o.bandwidth_limit_tok_s})
    return out


def comparison_lines(comparison: list[dict]) -> list[str]:
    """The comparison as a table: ours / baseline at the same batch and threads (median
    of the rounds' ratios, their range in brackets), and at batch 1 the decode speeds as
    shares of their bandwidth limits."""
    if not comparison:
        return []
    title = "ours / baseline (same batch and threads; per-round ratios)"
    lines = [f"# {title:<61} {'batch':>5}  {'decode':<20} prefill"]
    for c in comparison:
        name = f"compress {c['scheme']}" + (f" (kv {c['kv_cache']})" if c["kv_cache"] else "")
        cells = [f"{c[k]:5.2f}x [{c[k + '_range'][0]:.2f}-{c[k + '_range'][1]:.2f}]"
                 for k in ("decode_ratio", "prefill_ratio")]
        line = f"# {name + ' / ' + c['baseline']:<61} {c['batch']:>5}  {cells[0]:<20} {cells[1]:<20}"
        if c["batch"] == 1:
            line += (f"  decode at {c['decode_of_limit']:.0%} of the bandwidth limit "
                     f"({c['baseline_decode_of_limit']:.0%} for {c['baseline']})")
        lines.append(line.rstrip())
    return lines


def main(args) -> int:
    result = run(args)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f"# wrote {args.json}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="*", help="compress checkpoints (exported dirs) to run on our runtime")
    p.add_argument("--hf", help="the dense HF source directory, for llama.cpp and transformers")
    p.add_argument("--engines", nargs="*", default=["compress", "llamacpp", "transformers"],
                   choices=["compress", "llamacpp", "transformers"])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=positive_int)
    p.add_argument("--dtype", default="float32", help="activation dtype of our runtime")
    p.add_argument("--w4-activations", nargs="*", default=["float", "int8"], choices=["float", "int8"],
                   help="our int4 layers' activations, one run each: float (the w4a16 scheme's numbers) and int8 "
                        "per block of 32 (the CPU fast path, as llama.cpp's Q4 x Q8; scheme 'w4a16/int8-act')")
    p.add_argument("--kv-cache-dtypes", nargs="*", default=["model", "float16"], choices=["model", "float16", "int8"],
                   help="KV cache types to run our runtime with: 'model' (= --dtype, exact), float16 "
                        "(what llama.cpp keeps) and/or int8 (a scale a row)")
    p.add_argument("--hf-dtypes", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--gguf-types", nargs="*", default=["q4_0", "q8_0"], choices=["q4_0", "q8_0", "f16"])
    p.add_argument("--llamacpp-dir", help="where `compress bench llamacpp` built llama.cpp's tools "
                                         "(default: ~/.cache/compress/llamacpp)")
    p.add_argument("--gguf-dir", help="where converted GGUF files are cached (default: gguf/<source> under "
                                      "the llama.cpp tools' directory)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where our runtime and transformers run (cuda: the limit is a device copy's GB/s; "
                        "llama.cpp is left out)")
    p.add_argument("--cuda-graphs", nargs="*", default=["on"], choices=["on", "off"],
                   help="--device cuda: decode steps replayed from CUDA graphs (on) or launched kernel by kernel (off)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--json", help="write the records to this file")
