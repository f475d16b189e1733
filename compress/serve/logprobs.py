"""Log-probabilities of tokens, and their two OpenAI shapes.

:func:`prompt_logprobs` scores a prompt from its logits (what ``echo`` with ``logprobs``
returns; lm-eval's ``local-completions`` reads its loglikelihoods from it): for every
token after the first, log p(token | tokens before it) and the ``k`` most likely
alternatives, both taken from the same fp32 ``log_softmax`` so that "the token is the
top-1" is an exact comparison of equal floats. The first token has no logprob (``None``),
as OpenAI and vLLM answer.

:class:`TokenLogprob` is one scored token; :func:`completion_logprobs` lays a list of them
out as the legacy completions object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``), :func:`chat_logprobs` as the chat object (``content: [{token,
logprob, bytes, top_logprobs}]``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

ROWS_PER_CHUNK = 512   # log_softmax a few hundred positions at a time: [chunk, vocab] temporaries


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None                      # None: the prompt's first token
    top: list[tuple[int, float]] = field(default_factory=list)   # most likely first


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_k: int,
                    head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[TokenLogprob]:
    """``logits [T, V]`` of a prompt of ``T`` tokens -> one :class:`TokenLogprob` per token.
    With ``head`` (hidden states -> logits), ``logits`` are the final hidden states
    ``[T, H]`` and the head runs a chunk of positions at a time, so a long prompt over a
    large vocabulary never holds its whole ``[T, V]`` logits (2,048 x 128k fp32: 1 GiB)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if logits.dim() != 2 or logits.shape[0] != ids.numel():
        raise ValueError(f"prompt_logprobs: logits {tuple(logits.shape)} do not match {ids.numel()} tokens")
    out = [TokenLogprob(int(ids[0]), None)]
    for start in range(0, ids.numel() - 1, ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, ids.numel() - 1)
        rows = logits[start:stop] if head is None else head(logits[start:stop])
        lp = torch.log_softmax(rows.float(), dim=-1)
        targets = ids[start + 1:stop + 1]
        chosen = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
        if top_k > 0:
            values, indices = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            tops = [[] for _ in chosen]
        out.extend(TokenLogprob(int(t), c, top) for t, c, top in zip(targets.tolist(), chosen, tops))
    return out


def from_engine(token_id: int, entry, top_k: int) -> TokenLogprob:
    """The engine's logprob record of one generated token: a float, a ``{token_id: logprob}``
    dict (the chosen token among them), an object with ``logprob`` and ``top_logprobs``, or a
    ``(logprob, {id: logprob})`` pair."""
    chosen, top = None, {}
    if isinstance(entry, (int, float)):
        chosen = float(entry)
    elif isinstance(entry, dict):
        top = entry
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        chosen, top = entry[0], entry[1] or {}
    else:
        chosen = getattr(entry, "logprob", None)
        top = getattr(entry, "top_logprobs", None) or getattr(entry, "top", None) or {}
    top = {int(k): float(getattr(v, "logprob", v)) for k, v in dict(top).items()}
    if chosen is None:
        chosen = top.get(int(token_id))
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:top_k]
    return TokenLogprob(int(token_id), None if chosen is None else float(chosen), ranked)


def completion_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str],
                        text_offset: int = 0) -> dict:
    """The completions API's ``logprobs`` object. Alternatives whose text coincides keep
    the more likely one (the object is keyed by token text, as OpenAI's is); the chosen
    token is among them even when it is not in the top ``k`` (as OpenAI and vLLM answer,
    so ``logprobs=0`` gives the chosen token alone). ``text_offset``: where the first
    token starts in the answer's text; each token then advances it by its text's length."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        offsets.append(text_offset)
        text_offset += len(text)
        if e.logprob is None:
            top_logprobs.append(None)
            continue
        alternatives: dict[str, float] = {}
        for tid, lp in e.top:
            alternatives.setdefault(token_text(tid), lp)
        alternatives.setdefault(text, e.logprob)   # the chosen token is always there (k + 1 at most)
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], token_bytes: Callable[[int], bytes]) -> dict:
    """The chat API's ``logprobs`` object: each token's ``bytes`` are the token's own
    (a part of a UTF-8 character included), its ``token`` those bytes as text."""
    def item(tid, lp):
        raw = token_bytes(tid)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
