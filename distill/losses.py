"""Distillation losses as pure tensor functions: logits ``[..., vocab]`` in, a scalar
(mean over tokens) out, computed in float32.

- :func:`forward_kl`: KL(teacher || student) at temperature ``T``, scaled by ``T**2`` so
  the gradient's size does not depend on ``T`` (Hinton et al. 2015). With ``top_k``
  the teacher's distribution is its top-k tokens renormalized (sparse KD: the student's
  log-probabilities stay over the whole vocabulary, so its mass elsewhere is penalized).
- :func:`reverse_kl`: KL(student || teacher) at ``T`` (mode seeking); with ``top_k``
  both distributions are renormalized over the teacher's top-k tokens.
- :func:`next_token_ce`: cross-entropy of the student on the data's next tokens.
- :func:`hidden_cosine`: 1 - cosine between projected student and teacher hidden states.
- :func:`mixed_loss`: the weighted sum of the above, with every part reported.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _top_k(teacher_logits: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's top-k logits and their vocabulary indices (all, None when no k)."""
    if k is None or k >= teacher_logits.shape[-1]:
        return teacher_logits, None
    values, idx = teacher_logits.topk(k, dim=-1)
    return values, idx


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
               top_k: int | None = None) -> torch.Tensor:
    """Mean over tokens of T^2 * sum_v p_t(v) (log p_t(v) - log p_s(v)), both at temperature T."""
    t = float(temperature)
    log_s = F.log_softmax(student_logits.float() / t, dim=-1)
    values, idx = _top_k(teacher_logits.float(), top_k)
    log_t = F.log_softmax(values / t, dim=-1)
    if idx is not None:
        log_s = log_s.gather(-1, idx)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return kl.mean() * t * t


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
               top_k: int | None = None) -> torch.Tensor:
    """Mean over tokens of T^2 * sum_v p_s(v) (log p_s(v) - log p_t(v)), both at temperature T."""
    t = float(temperature)
    values, idx = _top_k(teacher_logits.float(), top_k)
    s = student_logits.float()
    if idx is not None:
        s = s.gather(-1, idx)
    log_s = F.log_softmax(s / t, dim=-1)
    log_t = F.log_softmax(values / t, dim=-1)
    kl = (log_s.exp() * (log_s - log_t)).sum(-1)
    return kl.mean() * t * t


def next_token_ce(student_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of position i's logits against token i + 1 of ``ids`` ``[batch, seq]``."""
    logits = student_logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def hidden_cosine(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor],
                  projections) -> torch.Tensor:
    """Mean over the matched pairs of 1 - cos(proj_i(h_s_i), h_t_i), averaged over tokens."""
    losses = [1 - F.cosine_similarity(p(hs.float()), ht.float(), dim=-1).mean()
              for hs, ht, p in zip(student_hidden, teacher_hidden, projections)]
    return torch.stack(losses).mean()


def mixed_loss(weights: dict[str, float], student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               ids: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               hidden: tuple | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_name weights[name] * loss_name`` over forward_kl, reverse_kl, ce and hidden
    (``hidden`` = (student states, teacher states, projections)); returns (total, parts)
    with only the parts whose weight is not zero computed."""
    parts: dict[str, torch.Tensor] = {}
    if weights.get("forward_kl", 0):
        parts["forward_kl"] = forward_kl(student_logits, teacher_logits, temperature, top_k)
    if weights.get("reverse_kl", 0):
        parts["reverse_kl"] = reverse_kl(student_logits, teacher_logits, temperature, top_k)
    if weights.get("ce", 0):
        parts["ce"] = next_token_ce(student_logits, ids)
    if weights.get("hidden", 0):
        if hidden is None:
            raise ValueError("a hidden-state loss weight needs the hidden states and projections")
        parts["hidden"] = hidden_cosine(*hidden)
    if not parts:
        raise ValueError("every loss weight is zero: give forward_kl, reverse_kl, ce or hidden a weight > 0")
    total = sum(weights[name] * value for name, value in parts.items())
    return total, parts
