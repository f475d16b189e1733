"""Perplexity of a text file with rolling (sliding) windows.

The text is one token stream (BOS first when the tokenizer adds one). Windows of
``seq_len`` tokens advance ``stride`` tokens at a time; each window scores only the tokens
that no earlier window scored, so every token after the first is predicted exactly once,
with ``seq_len - stride`` tokens (or more) of context once the first window is past.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from evals.backend import encode, logprobs, read_text


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float          # summed negative log-likelihood (nats)
    tokens: int         # tokens scored
    seq_len: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_nll": self.mean_nll}


def rolling_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_scored)`` per window; together they score tokens 1..n_tokens-1 once.

    The first window is ``[0, seq_len)``; each later one ends ``min(stride, seq_len - 1)``
    tokens further and starts ``seq_len`` tokens before its end, scoring its last
    ``n_scored`` tokens (every scored token has at least ``seq_len - stride`` tokens of
    context, and at least one).
    """
    if seq_len < 2 or not 1 <= stride <= seq_len:
        raise ValueError(f"need seq_len >= 2 and 1 <= stride <= seq_len (got {seq_len}, {stride})")
    if n_tokens < 2:
        return []
    end = min(seq_len, n_tokens)
    out = [(0, end, end - 1)]
    step = min(stride, seq_len - 1)
    while end < n_tokens:
        new_end = min(end + step, n_tokens)
        out.append((max(0, new_end - seq_len), new_end, new_end - end))
        end = new_end
    return out


@torch.no_grad()
def stream_nll(llm, ids: torch.Tensor, seq_len: int, stride: int, batch_size: int = 4,
               progress: bool = True, desc: str = "perplexity") -> tuple[float, int]:
    """Summed NLL (float64) and number of scored tokens of a 1-D token stream."""
    windows = rolling_windows(len(ids), seq_len, stride)
    nll, count = 0.0, 0
    bar = tqdm(total=len(windows), desc=desc, disable=not progress, unit="win")
    i = 0
    while i < len(windows):
        # batch consecutive windows of the same length (all but the last are seq_len long)
        width = windows[i][1] - windows[i][0]
        batch = [windows[i]]
        while (len(batch) < batch_size and i + len(batch) < len(windows)
               and windows[i + len(batch)][1] - windows[i + len(batch)][0] == width):
            batch.append(windows[i + len(batch)])
        inp = torch.stack([ids[b:e] for b, e, _ in batch])
        lp = logprobs(llm, inp)[:, :-1]                             # predicts positions 1..T-1
        tok_lp = lp.gather(-1, inp[:, 1:, None]).squeeze(-1).double()
        for row, (_, _, n) in enumerate(batch):
            nll -= float(tok_lp[row, -n:].sum())
            count += n
        i += len(batch)
        bar.update(len(batch))
    bar.close()
    return nll, count


def perplexity(llm, file: str | Path | None = None, *, text: str | None = None,
               seq_len: int = 512, stride: int = 256, max_tokens: int | None = None,
               batch_size: int = 4, progress: bool = True) -> PerplexityResult:
    """Rolling-window perplexity of ``file`` (or ``text``) under ``llm``."""
    ids = encode(llm, read_text(file, text))
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"evaluation text {file or '<text>'} has fewer than 2 tokens")
    nll, count = stream_nll(llm, ids, seq_len, stride, batch_size, progress)
    return PerplexityResult(perplexity=math.exp(nll / count), nll=nll, tokens=count,
                            seq_len=seq_len, stride=stride)
