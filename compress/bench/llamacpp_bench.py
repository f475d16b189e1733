"""llama.cpp as the baseline of ``compress bench model``, run through its own native tools
(built by ``compress bench llamacpp``) rather than a Python binding in our process:

* the dense HF source -> F16 GGUF with llama.cpp's ``convert_hf_to_gguf.py``, then Q4_0 /
  Q8_0 with ``llama-quantize`` (cached; a changed source makes new files);
* batch 1: ``llama-bench -o json`` -- prefill ``pp P`` on an empty context, decode ``tg N``
  after a ``P``-token context (``-d P``), as our runtime decodes after its prompt;
* batch 16 (any batch > 1): ``llama-batched-bench`` with ``-npl B``, B distinct prompts of
  P tokens, then N decode steps of B tokens; its table's S_PP / S_TG columns.

The parsers take the tools' text so that tests feed them captured samples."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from compress.bench.llamacpp import LlamaCppTools, LlamaCppToolsError

GGUF_TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "f16": "F16"}  # --gguf-types -> llama-quantize's type name


class LlamaCppRunError(LlamaCppToolsError):
    """A llama.cpp tool failed or printed what we cannot read."""


# ---------------------------------------------------------------- parsing
def parse_llama_bench_json(text: str) -> list[dict]:
    """llama-bench ``-o json`` -> one dict per test: ``kind`` (``pp`` prompt processing,
    ``tg`` generation, ``pg`` both), ``n_tokens``, ``n_depth`` (tokens already in the
    context), ``tok_s`` (``avg_ts``), ``samples_ts``, ``threads``, ``model_size``,
    ``type_k`` (the KV cache type)."""
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except ValueError as e:
        raise LlamaCppRunError(f"llama-bench printed no readable JSON ({e}): {text[:300]!r}") from None
    if not isinstance(tests, list) or not tests:
        raise LlamaCppRunError(f"llama-bench printed no tests: {text[:300]!r}")
    out = []
    for t in tests:
        try:
            kind = "pp" if t["n_gen"] == 0 else "tg" if t["n_prompt"] == 0 else "pg"
            out.append({"kind": kind, "n_tokens": int(t["n_prompt"] or t["n_gen"]),
                        "n_depth": int(t.get("n_depth", 0)), "tok_s": float(t["avg_ts"]),
                        "samples_ts": [float(s) for s in t.get("samples_ts", [])],
                        "threads": int(t["n_threads"]), "model_size": int(t["model_size"]),
                        "type_k": t.get("type_k", "")})
        except (KeyError, TypeError, ValueError) as e:
            raise LlamaCppRunError(f"llama-bench JSON test lacks or garbles {e}: {t!r}") from None
    return out


def select_test(tests: list[dict], kind: str, n_tokens: int, n_depth: int) -> dict:
    """The one test of ``kind`` over ``n_tokens`` at ``n_depth``; an error if absent."""
    for t in tests:
        if (t["kind"], t["n_tokens"], t["n_depth"]) == (kind, n_tokens, n_depth):
            return t
    have = ", ".join(f"{t['kind']}{t['n_tokens']}@d{t['n_depth']}" for t in tests)
    raise LlamaCppRunError(f"llama-bench printed no {kind}{n_tokens} test at depth {n_depth} (it has: {have})")


_BATCHED_COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's markdown table (its default output) -> one dict per row:
    ``pp``, ``tg``, ``batch`` (the ``B`` column, = ``-npl``), ``prefill_tok_s`` (S_PP),
    ``decode_tok_s`` (S_TG, all sequences together)."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if tuple(cells) == _BATCHED_COLUMNS:
                header = cells
            continue
        if set("".join(cells)) <= set("-"):
            continue
        try:
            v = dict(zip(header, cells))
            rows.append({"pp": int(v["PP"]), "tg": int(v["TG"]), "batch": int(v["B"]),
                         "prefill_tok_s": float(v["S_PP t/s"]), "decode_tok_s": float(v["S_TG t/s"])})
        except (KeyError, ValueError):
            raise LlamaCppRunError(f"llama-batched-bench row not understood: {line!r}") from None
    if header is None:
        raise LlamaCppRunError("llama-batched-bench printed no results table (header "
                               f"{' | '.join(_BATCHED_COLUMNS)}): {text[-400:]!r}")
    return rows


# ---------------------------------------------------------------- running
def _run_tool(cmd: list[str], what: str, env: dict | None = None, stdout_only: bool = False) -> str:
    """The tool's stdout (and its stderr after it, unless ``stdout_only``: llama.cpp
    logs to stderr, and llama-batched-bench prints its table there too)."""
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise LlamaCppRunError(f"{what} failed (exit {res.returncode}): {' '.join(cmd)}\n"
                               f"{(res.stderr or res.stdout).strip()[-1500:]}")
    return res.stdout if stdout_only else res.stdout + "\n" + res.stderr


def llama_bench_batch1(tools: LlamaCppTools, gguf: Path, prompt_len: int, new_tokens: int,
                       threads: int, reps: int = 1) -> tuple[float, float]:
    """(prefill tok/s of ``pp prompt_len`` on an empty context, decode tok/s of
    ``tg new_tokens`` after ``prompt_len`` tokens of context) from one ``llama-bench``
    run (it also times the other two combinations of ``-d 0,P``; they are not used)."""
    cmd = [tools.tool("llama-bench"), "-m", str(gguf), "-p", str(prompt_len), "-n", str(new_tokens),
           "-d", f"0,{prompt_len}", "-t", str(threads), "-r", str(reps), "-o", "json"]
    tests = parse_llama_bench_json(_run_tool(cmd, "llama-bench", stdout_only=True))
    return (select_test(tests, "pp", prompt_len, 0)["tok_s"],
            select_test(tests, "tg", new_tokens, prompt_len)["tok_s"])


def batched_bench(tools: LlamaCppTools, gguf: Path, batch: int, prompt_len: int, new_tokens: int,
                  threads: int) -> tuple[float, float]:
    """(prefill tok/s of ``batch`` prompts, decode tok/s of ``batch`` sequences) from one
    ``llama-batched-bench`` run."""
    ctx = batch * (prompt_len + new_tokens) + 16
    cmd = [tools.tool("llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", str(batch), "-t", str(threads),
           "-tb", str(threads), "-fit", "off"]
    text = _run_tool(cmd, "llama-batched-bench")
    rows = [r for r in parse_batched_bench(text) if r["batch"] == batch]
    if not rows:
        raise LlamaCppRunError(f"llama-batched-bench printed no row for batch {batch} (context {ctx}): "
                               f"{' '.join(cmd)}\n{text.strip()[-800:]}")
    return rows[0]["prefill_tok_s"], rows[0]["decode_tok_s"]


def llamacpp_runner(tools: LlamaCppTools, gguf: Path, batch: int, prompt_len: int, new_tokens: int,
                    threads: int):
    """``one_round() -> (prefill tok/s, decode tok/s)`` for ``compress bench model``'s
    alternation: one native tool run per round (each tool warms up before it times)."""
    if batch == 1:
        return lambda: llama_bench_batch1(tools, gguf, prompt_len, new_tokens, threads)
    return lambda: batched_bench(tools, gguf, batch, prompt_len, new_tokens, threads)


# ---------------------------------------------------------------- GGUF files
def source_key(hf_dir: str | Path) -> str:
    """A short key of the HF source (its path, and its files' sizes and mtimes): a
    changed checkpoint gets new GGUF files rather than stale ones."""
    hf_dir = Path(hf_dir).resolve()
    h = hashlib.sha256(str(hf_dir).encode())
    for f in sorted(hf_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"{hf_dir.name}-{h.hexdigest()[:12]}"


def _converter_env(tools: LlamaCppTools) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = tools.gguf_py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def make_gguf(tools: LlamaCppTools, hf_dir: str | Path, qtype: str, cache_dir: Path, threads: int,
              log=print) -> Path:
    """``cache_dir``/model-<qtype>.gguf from the HF source: converted to F16 by llama.cpp's
    converter, then quantized by ``llama-quantize``; each file written under a temporary
    name and renamed, so the cache never holds half a file."""
    if qtype not in GGUF_TYPES:
        raise LlamaCppToolsError(f"unknown GGUF type {qtype!r}; choose one of {sorted(GGUF_TYPES)}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    f16 = cache_dir / "model-f16.gguf"
    if not f16.exists():
        tmp = cache_dir / "model-f16.gguf.tmp"
        try:
            convert_to_f16(tools, Path(hf_dir), tmp)
        except LlamaCppRunError as e:
            if UNKNOWN_PRE_TOKENIZER not in str(e) or (Path(hf_dir) / "tokenizer.model").exists():
                raise
            log(f"# llama.cpp's converter does not know {hf_dir}'s BPE pre-tokenizer: converting with a "
                "stand-in SentencePiece tokenizer.model (the benchmark feeds token ids; speed is unchanged)")
            convert_to_f16(tools, stand_in_tokenizer_dir(Path(hf_dir), cache_dir / "hf-stand-in-tokenizer", log),
                           tmp)
        tmp.replace(f16)
    if qtype == "f16":
        return f16
    out = cache_dir / f"model-{qtype}.gguf"
    if not out.exists():
        tmp = cache_dir / f"model-{qtype}.gguf.tmp"
        _run_tool([tools.tool("llama-quantize"), str(f16), str(tmp), GGUF_TYPES[qtype], str(threads)],
                  f"llama-quantize {f16} to {GGUF_TYPES[qtype]}")
        tmp.replace(out)
    return out


UNKNOWN_PRE_TOKENIZER = "BPE pre-tokenizer was not recognized"


def convert_to_f16(tools: LlamaCppTools, hf_dir: Path, out: Path) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py --outtype f16`` in a child process of this
    interpreter, with its own gguf-py first on the path."""
    try:
        _run_tool([sys.executable, tools.converter, str(hf_dir), "--outtype", "f16", "--outfile", str(out)],
                  f"llama.cpp's convert_hf_to_gguf.py on {hf_dir}", env=_converter_env(tools))
    except LlamaCppRunError as e:
        missing = re.search(r"No module named '([\w.]+)'", str(e))
        if missing:
            module = missing.group(1).split(".")[0]
            raise LlamaCppRunError(f"llama.cpp's convert_hf_to_gguf.py needs the Python package {module!r}: "
                                   f"pip install {module}") from None
        raise


def stand_in_tokenizer_dir(hf_dir: Path, dest: Path, log=print) -> Path:
    """``dest``: the files of ``hf_dir`` as symbolic links plus a small SentencePiece
    ``tokenizer.model`` (which the converter reads first), for a source whose tokenizer
    llama.cpp's converter refuses. The vocabulary is padded to the model's size."""
    from compress.bench.make_model import train_sentencepiece

    if (dest / "tokenizer.model").is_file():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in Path(hf_dir).resolve().iterdir():
        if f.is_file() and f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (dest / f.name).symlink_to(f)
    if not train_sentencepiece(dest, log):
        raise LlamaCppRunError(f"{hf_dir}: llama.cpp's converter refuses its tokenizer, and a stand-in "
                               "SentencePiece model needs the sentencepiece package: pip install sentencepiece")
    return dest


def gguf_streamed_bytes(tools: LlamaCppTools, gguf: Path) -> int:
    """Bytes of a GGUF's tensors that a decode step reads: all but the token embedding
    table (one row per token), which counts when it doubles as the output (tied, no
    ``output.weight``). Read with llama.cpp's own gguf-py, in a child process."""
    code = ("import json, sys, gguf; r = gguf.GGUFReader(sys.argv[1]); "
            "print(json.dumps({t.name: int(t.n_bytes) for t in r.tensors}))")
    sizes = json.loads(_run_tool([sys.executable, "-c", code, str(gguf)], f"reading {gguf}",
                                 env=_converter_env(tools), stdout_only=True))
    return streamed_bytes_of(sizes)


def streamed_bytes_of(tensor_bytes: dict[str, int]) -> int:
    skip = {"token_embd.weight"} if "output.weight" in tensor_bytes else set()
    return sum(n for name, n in tensor_bytes.items() if name not in skip and "rope_freqs" not in name)
