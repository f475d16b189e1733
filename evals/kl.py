"""KL(base || stage) of next-token distributions over a fixed set of token windows.

The base model's log-probs are computed once (:func:`build_kl_reference`) and kept in
memory, either whole (``top_k=None``) or as the top-k entries per position. With top-k
the remaining probability mass of each distribution is one extra bucket, which gives a
lower bound on the true KL (exact when ``top_k`` covers the vocabulary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from evals.backend import encode, logprobs, read_text


@dataclass
class KLReference:
    input_ids: torch.Tensor          # [W, T] long
    logprobs: torch.Tensor           # [W, T, V] or [W, T, K] float32 (base log-probs)
    indices: torch.Tensor | None     # [W, T, K] long (top-k vocabulary ids, sorted) or None
    vocab_size: int

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file
        t = {"input_ids": self.input_ids, "logprobs": self.logprobs.contiguous(),
             "vocab_size": torch.tensor(self.vocab_size)}
        if self.indices is not None:
            t["indices"] = self.indices.contiguous()
        tmp = Path(str(path) + ".tmp")
        save_file(t, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "KLReference":
        from safetensors.torch import load_file
        t = load_file(str(path))
        return cls(t["input_ids"], t["logprobs"], t.get("indices"), int(t["vocab_size"]))


@dataclass
class KLResult:
    kl: float               # mean KL(base || stage) per token position, nats
    top1_agreement: float   # fraction of positions where both argmaxes agree
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def kl_windows(llm, file: str | Path | None = None, *, text: str | None = None,
               windows: int = 8, seq_len: int = 256) -> torch.Tensor:
    """The first ``windows`` non-overlapping ``seq_len`` windows of the text's token stream."""
    ids = encode(llm, read_text(file, text))
    n = min(windows, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def _batches(llm, input_ids: torch.Tensor, batch_size: int, desc: str, progress: bool):
    for i in tqdm(range(0, len(input_ids), batch_size), desc=desc, disable=not progress):
        yield i, logprobs(llm, input_ids[i:i + batch_size])


@torch.no_grad()
def build_kl_reference(llm, file: str | Path | None = None, *, text: str | None = None,
                       windows: int = 8, seq_len: int = 256, top_k: int | None = None,
                       batch_size: int = 4, progress: bool = True) -> KLReference:
    """Base log-probs over the first ``windows`` windows of the text (whole or top-k)."""
    ids = kl_windows(llm, file, text=text, windows=windows, seq_len=seq_len)
    vals, idxs, vocab = [], [], None
    for _, lp in _batches(llm, ids, batch_size, "kl reference", progress):
        vocab = lp.shape[-1]
        if top_k and top_k < vocab:
            v, i = torch.topk(lp, top_k, dim=-1)
            vals.append(v)
            idxs.append(i)
        else:
            vals.append(lp)
    return KLReference(ids, torch.cat(vals), torch.cat(idxs) if idxs else None, vocab)


def kl_per_position(base_lp: torch.Tensor, stage_lp: torch.Tensor,
                    base_idx: torch.Tensor | None = None) -> torch.Tensor:
    """KL(base || stage) per position. ``base_lp`` whole ``[..., V]`` or top-k with ``base_idx``."""
    if base_idx is None:
        return (base_lp.exp() * (base_lp - stage_lp)).sum(-1)
    q_top = stage_lp.gather(-1, base_idx)
    p_top = base_lp.exp()
    kl = (p_top * (base_lp - q_top)).sum(-1)
    tail_p = (1 - p_top.sum(-1)).clamp_min(0)
    tail_q = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
    tail = torch.where(tail_p > 0, tail_p * (tail_p.clamp_min(1e-12).log() - tail_q.log()),
                       torch.zeros_like(tail_p))
    return kl + tail


@torch.no_grad()
def kl_to_reference(llm, ref: KLReference, batch_size: int = 4,
                    progress: bool = True) -> KLResult:
    """Mean KL(base || llm) and top-1 agreement over the reference's token positions."""
    total, agree = 0.0, 0
    for i, lp in _batches(llm, ref.input_ids, batch_size, "kl to base", progress):
        if lp.shape[-1] != ref.vocab_size:
            raise ValueError(f"vocabulary size {lp.shape[-1]} differs from the base's {ref.vocab_size}")
        base = ref.logprobs[i:i + len(lp)]
        idx = None if ref.indices is None else ref.indices[i:i + len(lp)]
        total += float(kl_per_position(base, lp, idx).double().sum())
        base_top1 = base.argmax(-1) if idx is None else idx[..., 0]
        agree += int((lp.argmax(-1) == base_top1).sum())
    n = ref.tokens
    return KLResult(kl=total / n, top1_agreement=agree / n, tokens=n)
