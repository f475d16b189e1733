"""Teacher-forced engine steps for tests: a model's logits for a batch of prompts and
then fixed decode tokens, through the model runner over a paged KV cache (the module
path, or a native decode step when given one)."""
from __future__ import annotations

import torch

from compress.runtime.block_manager import BlockManager
from compress.runtime.kv_cache import PagedKVCache
from compress.runtime.model_runner import ModelRunner
from compress.runtime.sampling import SamplingParams
from compress.runtime.sequence import Sequence


def fed_token(step: int, row: int) -> int:
    """The token row ``row`` is fed at decode step ``step``."""
    return (7 * step + 3 * row) % 50 + 2


def step_logits(model, prompts: list[list[int]], steps: int, kv_dtype=None, native=None,
                block_size: int = 4) -> list[torch.Tensor]:
    """Logits ``[B, V]`` of each prompt's last token, then of ``steps`` decode steps that
    feed ``fed_token(step, row)``; the rows are prefilled together in one step."""
    longest = max(len(p) for p in prompts) + steps
    num_blocks = len(prompts) * -(-longest // block_size) + 1
    cache = PagedKVCache(len(model.layers), num_blocks, model.n_kv_heads, block_size, model.head_dim,
                         kv_dtype or model.dtype, model.device)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    runner = ModelRunner(model, cache, native)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(str(r), None, p, params, set()) for r, p in enumerate(prompts)]
    for s in seqs:
        blocks.allocate(s, [], s.num_tokens)
    out = []
    for step in range(steps + 1):
        result = runner.run(seqs, [s.num_tokens - s.num_computed_tokens for s in seqs])
        assert result.sampled == list(range(len(seqs)))
        order = {id(s): r for r, s in enumerate(result.seqs)}
        out.append(result.logits[[order[id(s)] for s in seqs]])
        for r, s in enumerate(seqs):
            s.num_computed_tokens = s.num_tokens
            if step < steps:
                s.append(fed_token(step, r))
                blocks.append_slots(s, 1)
    return out
