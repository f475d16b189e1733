#!/usr/bin/env python
"""How firm is "AWQ's perplexity gap is X% of RTN's"? Per-window NLL of a base model and
two quantized checkpoints on held-out text, then a bootstrap over the windows.

    python scripts/gap_bootstrap.py --base out/pydoc-qwen2 --rtn out/quantizers-qwen2/rtn-int4 \\
        --awq out/quantizers-qwen2/awq-int4 --text data/pydoc/eval.txt --site-packages 2.0

Text: any ``--text`` files, plus (``--site-packages MB``) that many megabytes of
docstrings extracted with ``scripts/pydoc_corpus.py``'s cleaner from the Python packages
installed beside this interpreter: held-out text in the models' domain (English API
documentation) that no compress model trains or calibrates on (they use the standard
library's). It is generated on the fly and never written to the repository.

Non-overlapping windows of ``--seq-len`` tokens; each window's summed NLL is computed
for the three models (runtime ``reference`` kernels by default: exact W4A16, no int8
activation blocks). The gap ratio is ``(NLL_awq - NLL_base) / (NLL_rtn - NLL_base)``
over the whole text; the bootstrap resamples windows with replacement.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def site_packages_text(megabytes: float) -> str:
    """Deterministic sample of installed packages' docstrings (files in SHA-1 order)."""
    from pydoc_corpus import file_docstrings

    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(root.rglob("*.py"), key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    docs, seen, size = [], set(), 0
    for path in files:
        if any(part in ("tests", "test", "testing") for part in path.relative_to(root).parts):
            continue
        for doc in file_docstrings(path):
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
                size += len(doc)
        if size >= megabytes * 1e6:
            break
    return "\n\n\n".join(docs)


def window_nll(llm, ids: torch.Tensor, seq_len: int, batch: int = 8) -> torch.Tensor:
    """Summed NLL of tokens 1..seq_len-1 of every non-overlapping window."""
    windows = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    out = []
    for i in range(0, windows.shape[0], batch):
        out.append(-llm.token_logprobs(windows[i:i + batch]).double().sum(dim=1))
    return torch.cat(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--rtn", required=True)
    p.add_argument("--awq", required=True, nargs="+", help="one or more AWQ checkpoints (each compared)")
    p.add_argument("--text", nargs="*", default=[])
    p.add_argument("--site-packages", type=float, default=0.0, metavar="MB",
                   help="add this many MB of installed packages' docstrings")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--kernels", default="reference", choices=["reference", "native"])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not args.text and not args.site_packages:
        p.error("give --text files and/or --site-packages MB")

    from compress.runtime import LLM

    torch.set_num_threads(args.threads)
    texts = [(f, Path(f).read_text(encoding="utf-8")) for f in args.text]
    if args.site_packages:
        texts.append((f"site-packages docstrings ({args.site_packages} MB)", site_packages_text(args.site_packages)))
    paths = [("base", args.base), ("rtn", args.rtn)] + [(f"awq:{path}", path) for path in args.awq]
    models = {name: LLM(path, kernels=args.kernels) for name, path in paths}
    gen = torch.Generator().manual_seed(0)
    for label, text in texts:
        ids = torch.tensor(models["base"].encode(text, add_special_tokens=False))
        nll = {name: window_nll(llm, ids, args.seq_len) for name, llm in models.items()}
        n_tok = nll["base"].numel() * (args.seq_len - 1)
        ppl = {name: float(torch.exp(v.sum() / n_tok)) for name, v in nll.items()}
        print(f"{label}: {nll['base'].numel()} windows x {args.seq_len} tokens ({n_tok} scored)")
        print(f"  perplexity base {ppl['base']:.3f}  rtn {ppl['rtn']:.3f} ({100 * (ppl['rtn'] / ppl['base'] - 1):+.3f}%)")
        d_rtn = nll["rtn"] - nll["base"]
        idx = torch.randint(0, d_rtn.numel(), (args.reps, d_rtn.numel()), generator=gen)
        for name in models:
            if not name.startswith("awq:"):
                continue
            d_awq = nll[name] - nll["base"]
            ratio = float(d_awq.sum() / d_rtn.sum())
            boot = d_awq[idx].sum(1) / d_rtn[idx].sum(1)
            lo, hi = (float(v) for v in torch.quantile(boot, torch.tensor([0.05, 0.95], dtype=boot.dtype)))
            print(f"  {name}: perplexity {ppl[name]:.3f} ({100 * (ppl[name] / ppl['base'] - 1):+.3f}%); "
                  f"AWQ gap / RTN gap = {ratio:.2f}, bootstrap 90% interval [{lo:.2f}, {hi:.2f}], "
                  f"P(ratio <= 0.5) = {float((boot <= 0.5).double().mean()):.2f}")


if __name__ == "__main__":
    main()
