"""How firm is "this checkpoint's perplexity gap is X% of that one's"? ``compress eval
PATH --base BASE --bootstrap OTHER...``: the per-window NLL of BASE, PATH and each OTHER
on one held-out text, then a bootstrap over the windows.

The text is cut into non-overlapping windows of ``seq_len`` tokens (BASE's tokenizer,
no special tokens); each window's NLL, summed over its tokens 1..seq_len-1, is computed
for every checkpoint, one checkpoint loaded at a time. A checkpoint's gap is its NLL
minus BASE's over the whole text; the ratio ``gap(PATH) / gap(OTHER)`` says how much of
OTHER's loss PATH keeps (e.g. PATH an AWQ export, OTHER the RTN one of the same scheme).
The bootstrap resamples the windows with replacement, seeded, and reports the central
``level`` interval of the resampled ratios."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compress.errors import UserError

DEFAULT_WINDOW = 256


class BootstrapError(UserError):
    """A bootstrap that cannot be computed (names the option or checkpoint)."""


@dataclass
class GapRatio:
    path: str
    other: str
    ratio: float  # gap(path) / gap(other) over the whole text
    low: float  # the central ``level`` interval of the bootstrap's ratios
    high: float
    level: float
    reps: int
    seed: int


def window_nll(llm, ids: torch.Tensor, seq_len: int, batch: int = 8) -> torch.Tensor:
    """Summed NLL (float64) of tokens 1..seq_len-1 of every non-overlapping window of ``ids``."""
    windows = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    out = [-llm.token_logprobs(windows[i:i + batch]).double().sum(dim=1) for i in range(0, windows.shape[0], batch)]
    return torch.cat(out)


def gap_ratio_interval(nll_base: torch.Tensor, nll_path: torch.Tensor, nll_other: torch.Tensor, reps: int = 2000,
                       seed: int = 0, level: float = 0.9) -> tuple[float, float, float]:
    """``(ratio, low, high)``: gap(path) / gap(other) over all windows, and the central
    ``level`` interval of the same ratio over ``reps`` resamplings of the windows."""
    d_path, d_other = nll_path - nll_base, nll_other - nll_base
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, d_path.numel(), (reps, d_path.numel()), generator=gen)
    boot = d_path[idx].sum(1) / d_other[idx].sum(1)
    tail = (1 - level) / 2
    low, high = torch.quantile(boot, torch.tensor([tail, 1 - tail], dtype=boot.dtype))
    return float(d_path.sum() / d_other.sum()), float(low), float(high)


def bootstrap_gaps(path: str, base: str, others: list[str], text_file: str, seq_len: int | None = None,
                   kernels: str = "reference", threads: int | None = None, reps: int = 2000, seed: int = 0,
                   level: float = 0.9, log=print) -> dict:
    """The record of ``compress eval PATH --base BASE --bootstrap OTHER...`` (see the module doc)."""
    from compress.runtime import LLM

    if not 0 < level < 1:
        raise BootstrapError(f"--bootstrap-level {level}: must be between 0 and 1")
    if reps < 1:
        raise BootstrapError(f"--bootstrap-reps {reps}: must be at least 1")
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except OSError as e:
        raise BootstrapError(f"--text {text_file}: {e.strerror or e}") from None
    nll: dict[str, torch.Tensor] = {}
    ids = None
    for label in dict.fromkeys([base, path, *others]):  # each checkpoint once, base first
        llm = LLM(label, kernels=kernels, threads=threads)
        if ids is None:  # base's tokenizer and context fix the windows
            if llm.tokenizer is None:
                raise BootstrapError(f"--base {base}: has no tokenizer to encode --text {text_file} with")
            seq_len = seq_len or min(DEFAULT_WINDOW, llm.max_seq_len)
            ids = torch.tensor(llm.encode(text, add_special_tokens=False))
            if ids.numel() // seq_len < 2:
                raise BootstrapError(f"--text {text_file}: {ids.numel()} tokens make fewer than 2 windows of "
                                     f"--seq-len {seq_len}")
        if seq_len > llm.max_seq_len:
            raise BootstrapError(f"--seq-len {seq_len} is longer than {label}'s context ({llm.max_seq_len})")
        log(f"scoring {label} ({ids.numel() // seq_len} windows of {seq_len} tokens)")
        nll[label] = window_nll(llm, ids, seq_len)
        del llm
    n_tok = nll[base].numel() * (seq_len - 1)
    comparisons = []
    for other in others:
        if torch.equal(nll[other], nll[base]):
            raise BootstrapError(f"--bootstrap {other}: scores exactly as --base on every window; its gap is 0 "
                                 "and the ratio undefined")
        ratio, low, high = gap_ratio_interval(nll[base], nll[path], nll[other], reps, seed, level)
        comparisons.append(asdict(GapRatio(path, other, ratio, low, high, level, reps, seed)))
    return {"text": str(text_file), "seq_len": seq_len, "windows": nll[base].numel(), "tokens_scored": n_tok,
            "kernels": kernels, "base": base,
            "perplexity": {label: float(torch.exp(v.sum() / n_tok)) for label, v in nll.items()},
            "comparisons": comparisons}


def render_bootstrap(record: dict) -> str:
    ppl = record["perplexity"]
    base = ppl[record["base"]]
    lines = [f"{record['text']}: {record['windows']} windows x {record['seq_len']} tokens "
             f"({record['tokens_scored']} scored, {record['kernels']} kernels)"]
    for label, value in ppl.items():
        lines.append(f"  perplexity {value:9.3f} ({100 * (value / base - 1):+.3f}% vs base)  {label}")
    for c in record["comparisons"]:
        lines.append(f"  gap({c['path']}) / gap({c['other']}) = {c['ratio']:.3f}, bootstrap "
                     f"{100 * c['level']:.0f}% interval [{c['low']:.3f}, {c['high']:.3f}] "
                     f"({c['reps']} resamplings of the windows, seed {c['seed']})")
    return "\n".join(lines)


def bootstrap_command(args) -> int:
    """``compress eval PATH --base BASE --bootstrap OTHER...`` (the parser's namespace)."""
    from compress.io.files import atomic_write_text
    from evals.eval_config import PerplexityConfig

    if not args.base:
        raise BootstrapError("--bootstrap compares gaps to a base model: give --base BASE")
    record = bootstrap_gaps(args.path, args.base, args.bootstrap, args.text or PerplexityConfig().file,
                            args.seq_len, args.kernels, args.threads, args.bootstrap_reps, args.bootstrap_seed,
                            args.bootstrap_level)
    print(render_bootstrap(record))
    if args.json:
        atomic_write_text(args.json, json.dumps(record, indent=2))
    return 0
