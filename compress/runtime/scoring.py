"""Log-likelihood scoring over cache-free batched forwards (what evals call).

* ``token_logprobs``: log p(x_t | x_<t) of every token of padded batches (perplexity).
* ``loglikelihood``: log p(continuation | context) summed, and whether greedy decoding
  would have produced the continuation (lm-eval's ``loglikelihood``).
The LM head is applied only at the positions that are scored, a chunk at a time, so
memory stays at ``[chunk, vocab]`` rather than ``[B, T, vocab]``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from compress.runtime.model_runner import ModelRunner

HEAD_CHUNK = 1024   # positions per LM-head call


class Loglikelihood(NamedTuple):
    logprob: float
    is_greedy: bool


def _head_logprobs(runner: ModelRunner, hidden: torch.Tensor, targets: torch.Tensor):
    """For hidden ``[N, H]`` and targets ``[N]``: (log-probs ``[N]``, argmax == target ``[N]``)."""
    lps, greedy = [], []
    for i in range(0, hidden.shape[0], HEAD_CHUNK):
        logits = runner.model.logits(hidden[i:i + HEAD_CHUNK])
        tgt = targets[i:i + HEAD_CHUNK].to(logits.device)
        lps.append(logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
        greedy.append(logits.argmax(-1) == tgt)
    return torch.cat(lps), torch.cat(greedy)


@torch.inference_mode()
def token_logprobs(runner: ModelRunner, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T-1]`` fp32: entry ``t-1`` is log p(x_t | x_<t); 0 where x_t is padding."""
    input_ids = torch.as_tensor(input_ids)
    hidden = runner.hidden_states(input_ids, attention_mask)
    b, t = input_ids.shape
    targets = input_ids[:, 1:].reshape(-1)
    lp, _ = _head_logprobs(runner, hidden[:, :-1].reshape(b * (t - 1), -1), targets)
    lp = lp.view(b, t - 1).cpu()
    if attention_mask is not None:
        lp = lp * torch.as_tensor(attention_mask)[:, 1:].to(lp.dtype)
    return lp


@torch.inference_mode()
def loglikelihood(runner: ModelRunner, pairs: list[tuple[list[int], list[int]]],
                  batch_size: int = 16) -> list[Loglikelihood]:
    """Score token-id ``(context, continuation)`` pairs. The model reads
    ``(context + continuation)[:-1]``, truncated on the left to ``max_seq_len``."""
    items = []
    for i, (ctx, cont) in enumerate(pairs):
        if not cont:
            raise ValueError(f"request {i}: empty continuation")
        if not ctx:
            raise ValueError(f"request {i}: empty context (pass at least a BOS token)")
        if len(cont) > runner.max_seq_len:
            raise ValueError(f"request {i}: continuation of {len(cont)} tokens exceeds "
                             f"max_seq_len={runner.max_seq_len}")
        items.append((i, (list(ctx) + list(cont))[:-1][-runner.max_seq_len:], list(cont)))
    items.sort(key=lambda it: -len(it[1]))
    results: list[Loglikelihood | None] = [None] * len(items)
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        t = len(chunk[0][1])
        ids = torch.zeros((len(chunk), t), dtype=torch.long)
        mask = torch.zeros((len(chunk), t), dtype=torch.long)
        for r, (_, inp, _) in enumerate(chunk):
            ids[r, :len(inp)] = torch.as_tensor(inp)
            mask[r, :len(inp)] = 1
        hidden = runner.hidden_states(ids, mask)
        rows = [hidden[r, len(inp) - len(cont):len(inp)] for r, (_, inp, cont) in enumerate(chunk)]
        targets = torch.as_tensor([tok for _, _, cont in chunk for tok in cont])
        lp, greedy = _head_logprobs(runner, torch.cat(rows), targets)
        offset = 0
        for idx, _, cont in chunk:
            n = len(cont)
            results[idx] = Loglikelihood(float(lp[offset:offset + n].sum()), bool(greedy[offset:offset + n].all()))
            offset += n
    return results
