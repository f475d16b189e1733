"""``compress bench model PATH``: prefill and decode tokens/s of a checkpoint on the
compress runtime, at batch 1 and 16, beside llama.cpp (Q4_0 / Q8_0 / F16 GGUF made from
the dense HF source with llama.cpp's own converter and quantizer) and transformers
``generate()``, with the bandwidth limit (DRAM read GB/s / weight bytes per token).
Engines alternate round by round (medians over ``--reps`` rounds)."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compress.bench.bandwidth import read_bandwidth
from compress.io.files import atomic_write_text


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
    from compress.runtime import SamplingParams

    prompts = _prompts(batch, prompt_len, llm.config.vocab_size)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    def one_round():
        m = llm.generate(prompts, params)[0].metrics
        return m["prompt_tokens"] / m["prefill_s"], m["batch_size"] * m["decode_steps"] / m["decode_s"]
    return one_round


# ---------------------------------------------------------------- transformers
def transformers_runner(model, batch: int, prompt_len: int, new_tokens: int):
    ids = torch.tensor(_prompts(batch, prompt_len, model.config.vocab_size))
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def gen(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t0

    gen(2)

    def one_round():
        t1 = gen(1)
        tn = gen(new_tokens)
        return batch * prompt_len / t1, batch * (new_tokens - 1) / max(tn - t1, 1e-9)
    return one_round


# ---------------------------------------------------------------- llama.cpp
def llamacpp_gguf(hf_dir: str, qtype: str, cache_dir: Path, converter: str | None) -> Path:
    """HF dir -> F16 GGUF (llama.cpp's convert_hf_to_gguf.py) -> Q4_0 / Q8_0 (llama.cpp's
    quantizer through llama-cpp-python's binding). Cached in ``cache_dir``."""
    import subprocess
    import sys

    import llama_cpp

    cache_dir.mkdir(parents=True, exist_ok=True)
    f16 = cache_dir / "model-f16.gguf"
    if not f16.exists():
        if converter is None:
            raise RuntimeError("llama.cpp engine needs --llamacpp-converter PATH/convert_hf_to_gguf.py "
                               "(from the llama-cpp-python source distribution; see scripts/bench_llamacpp.py)")
        conv = Path(converter)
        env = dict(__import__("os").environ)
        gguf_py = conv.parent / "gguf-py"
        if gguf_py.exists():
            env["PYTHONPATH"] = str(gguf_py) + ":" + env.get("PYTHONPATH", "")
        tmp = f16.with_suffix(".tmp")  # the cache must never hold a half-written file
        subprocess.run([sys.executable, str(conv), hf_dir, "--outtype", "f16", "--outfile", str(tmp)],
                       check=True, env=env)
        tmp.replace(f16)
    if qtype == "f16":
        return f16
    out = cache_dir / f"model-{qtype}.gguf"
    if not out.exists():
        ftype = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[qtype]
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        tmp = out.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama_model_quantize failed ({rc})")
        tmp.replace(out)
    return out


def llamacpp_runner(gguf: Path, prompt_len: int, new_tokens: int, threads: int, vocab: int):
    """Batch 1 only: llama-cpp-python's Llama drives one sequence."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=prompt_len + new_tokens + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(prompt_len, 32), verbose=False)
    prompt = _prompts(1, prompt_len, vocab)[0]

    def one_round():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = prompt[-1]
        for _ in range(new_tokens):
            llm.eval([tok])
            tok = (tok * 31 + 7) % (vocab - 3) + 3  # token values do not change the work
        t2 = time.perf_counter()
        return prompt_len / (t1 - t0), new_tokens / (t2 - t1)

    one_round()  # warm-up
    return one_round


# ---------------------------------------------------------------- command
def run(args, log=print) -> dict:
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    bw = read_bandwidth(int(args.bandwidth_mib) << 20)
    gbps = bw["best_gbps"]
    log(f"# threads={threads} DRAM read bandwidth: best {gbps:.1f} GB/s (median {bw['median_gbps']:.1f})")
    runners = []   # (engine, scheme, batch, weight bytes per token, one_round, kv cache type)
    engines = set(args.engines)
    if "compress" in engines:
        from compress.runtime import LLM
        for path in args.paths:
            for kv in args.kv_cache_dtypes:
                llm = LLM(path, dtype=args.dtype, kernels="native", threads=threads, max_batch_size=max(args.batch),
                          kv_cache_dtype=None if kv == "model" else kv)
                scheme = "+".join(sorted({getattr(mod, "scheme", None) for mod in llm.model.modules()} - {None}))
                kv_name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[llm.runner.kv_dtype]
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
            tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dt]
            model = AutoModelForCausalLM.from_pretrained(hf, dtype=tdtype).eval()
            torch.set_num_threads(threads)
            for b in args.batch:
                runners.append(("transformers", dt, b, _streamed_bytes(model),
                                transformers_runner(model, b, args.prompt_len, args.new_tokens),
                                {"float32": "f32", "bfloat16": "bf16"}[dt]))
    if hf and "llamacpp" in engines:
        cfg = json.loads((Path(hf) / "config.json").read_text())
        cache = Path(args.gguf_dir or (Path(hf).parent / "gguf"))
        for qt in args.gguf_types:
            gguf = llamacpp_gguf(hf, qt, cache, args.llamacpp_converter)
            nbytes = gguf.stat().st_size - cfg["vocab_size"] * cfg["hidden_size"] * {"f16": 2, "q8_0": 34 / 32,
                                                                                        "q4_0": 18 / 32}[qt]
            runners.append(("llama.cpp", qt, 1, int(nbytes),
                            llamacpp_runner(gguf, args.prompt_len, args.new_tokens, threads, cfg["vocab_size"]),
                            "f16"))
    rounds: list[list[tuple[float, float]]] = [[] for _ in runners]
    for r in range(args.reps):
        log(f"# round {r + 1}/{args.reps}: every engine in turn")
        for i, runner in enumerate(runners):
            rounds[i].append(runner[4]())
    records: list[ModelRecord] = []
    for (engine, scheme, batch, nbytes, _, kv), res in zip(runners, rounds):
        limit = gbps * 1e9 / nbytes * batch if nbytes else float("nan")
        rec = ModelRecord(engine, scheme, batch, threads, args.prompt_len, args.new_tokens,
                          _median([p for p, _ in res]), _median([d for _, d in res]), nbytes, limit, kv)
        records.append(rec)
        log(f"{engine:<13} {scheme:<14} kv {kv:<4} batch {batch:>3}  prefill {rec.prefill_tok_s:8.1f} tok/s  "
            f"decode {rec.decode_tok_s:7.1f} tok/s  (limit {limit:7.1f} tok/s, {nbytes / 1e6:6.1f} MB/token)")
    for line in decode_ratios(records):
        log(line)
    return {"bandwidth": bw, "records": [asdict(r) for r in records]}


def decode_ratios(records: list[ModelRecord]) -> list[str]:
    """Decode tok/s of each compress run over the other engines' at the same batch
    (llama.cpp: the GGUF type of the same bit width: int4 -> q4_0, int8 -> q8_0)."""
    lines = []
    for r in records:
        if r.engine != "compress":
            continue
        peer = "q4_0" if "w4a16" in r.scheme else "q8_0" if "w8a8" in r.scheme or "llm_int8" in r.scheme else None
        others = [o for o in records if o.batch == r.batch and (
            (o.engine == "llama.cpp" and o.scheme == peer) or o.engine == "transformers")]
        if others:
            parts = ", ".join(f"{r.decode_tok_s / o.decode_tok_s:.2f}x {o.engine} {o.scheme}" for o in others)
            kv = f" (kv {r.kv_cache})" if r.kv_cache else ""
            lines.append(f"# decode, batch {r.batch}: compress {r.scheme}{kv} = {parts}")
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
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", default="float32", help="activation dtype of our runtime")
    p.add_argument("--kv-cache-dtypes", nargs="*", default=["model", "float16"], choices=["model", "float16"],
                   help="KV cache types to run our runtime with: 'model' (= --dtype, exact) and/or float16 "
                        "(what llama.cpp keeps)")
    p.add_argument("--hf-dtypes", nargs="*", default=["float32", "bfloat16"])
    p.add_argument("--gguf-types", nargs="*", default=["q4_0", "q8_0"], choices=["q4_0", "q8_0", "f16"])
    p.add_argument("--gguf-dir", help="where converted GGUF files are cached (default: next to --hf)")
    p.add_argument("--llamacpp-converter", help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--json", help="write the records to this file")
