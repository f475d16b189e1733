"""``method: awq``: activation-aware weight quantization to groupwise int4 (W4A16).

Block by block (``compress/block_steps.py``): for each decoder block, for each scale group of the
architecture table (q/k/v after the attention norm, o after v, gate/up after the MLP
norm, down after up):

1. capture what the group's *inspected module* receives -- the attention module for
   q/k/v, the MLP for gate/up, the linear itself for o and down -- and its float output;
2. ``s_x`` = mean |activation| per input channel; grid-search ``alpha`` in
   ``s = s_x^alpha`` minimising the inspected module's output error when the group's
   weights are replaced by ``Q(W * s) / s`` (``quantizers/awq_search.py``);
3. fold ``1/s`` into the producing operator (RMSNorm weight, or the rows of v_proj /
   up_proj) and ``s`` into the group's weight columns: the float function is unchanged.

Then the scaled block's linears get a per-(row, group) clip search (q/k are skipped, as
clipping them distorts attention scores) and are quantized with
``primitives.quantize_int4_groupwise``, giving the same ``w4a16`` QuantizedWeight as RTN.
``group_size: channel`` (or -1) makes the group a whole row, in the search and the result.

GQA: o_proj reads ``heads * head_dim`` channels while v_proj writes ``kv_heads * head_dim``;
the v->o scale lives on v_proj's channels and is repeated for every query head that reads
the same kv head (``kv_head_maps``), so the fold stays exact. Embeddings, the final norm
and lm_head are never touched, so tied embeddings are unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from compress.block_steps import BlockStep, apply_whole_model, group_by_block
from compress.calibration import block_output
from compress.config import check
from compress.io.schemes import QuantizedWeight
from quantizers import primitives
from quantizers.awq_search import (activation_scale, fold_scale_into_linear, fold_scale_into_norm,
                                   kv_head_maps, search_clip, search_scale)
from quantizers.block_capture import capture_inputs
from quantizers.rtn import int4_quantized_weight
from quantizers.targets import select_linears


@dataclass
class AWQConfig:
    bits: Literal[4] = 4
    group_size: int | str = 128       # a multiple of 8, or "channel" / -1 (one scale per row)
    symmetric: bool = False
    n_grid: int = 20                  # alpha grid points in [0, 1)
    duo_scaling: bool = False         # s = s_x^a / s_w^(1-a) instead of s_x^a
    clip: bool = True                 # search a clip ratio per (row, group)
    clip_grid: int = 20
    max_shrink: float = 0.5           # clip ratios searched in [1 - max_shrink, 1]
    clip_tokens: int = 512            # calibration tokens used by the clip search
    # calibration tokens the scale search scores (0 = all of them, as AutoAWQ does). On
    # ~670k held-out tokens all 32k calibration tokens beat an 8,192-token subset on both
    # families (compress eval --bootstrap; figures in examples/quantizers.yaml)
    search_tokens: int = 0
    targets: list[str] = field(default_factory=lambda: ["re:.*layers\\.\\d+\\..*"])
    ignore: list[str] = field(default_factory=list)
    batch_size: int = 8

    def validate(self) -> None:
        problem = primitives.group_size_problem(self.group_size)
        check(problem is None, "group_size", problem or "")
        check(self.n_grid >= 1, "n_grid", f"must be >= 1, got {self.n_grid}")
        check(self.clip_grid >= 1, "clip_grid", f"must be >= 1, got {self.clip_grid}")
        check(0 <= self.max_shrink < 1, "max_shrink", f"must be in [0, 1), got {self.max_shrink}")
        check(self.clip_tokens > 0, "clip_tokens", f"must be > 0, got {self.clip_tokens}")
        check(self.search_tokens >= 0, "search_tokens", f"must be >= 0, got {self.search_tokens}")
        check(self.batch_size > 0, "batch_size", f"must be > 0, got {self.batch_size}")


def _limit_batches(captured: list, tokens: int) -> list:
    """Leading calibration batches holding at least ``tokens`` tokens (all if 0)."""
    if not tokens:
        return captured
    kept, seen = [], 0
    for item in captured:
        kept.append(item)
        seen += (item[0] if isinstance(item, tuple) else item)[..., 0].numel()
        if seen >= tokens:
            break
    return kept


def _token_sample(xs: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """``tokens`` rows spread evenly over all captured tokens (deterministic)."""
    flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])
    if flat.shape[0] <= tokens:
        return flat
    return flat[torch.linspace(0, flat.shape[0] - 1, tokens).long()]


class _SwappedWeights:
    """Temporarily replace module weights (restores the originals on exit)."""

    def __init__(self, modules: list[nn.Linear], weights: list[torch.Tensor]):
        self.modules, self.weights, self.saved = modules, weights, []

    def __enter__(self):
        for m, w in zip(self.modules, self.weights):
            self.saved.append(m.weight.data)
            m.weight.data = w.to(m.weight.dtype)

    def __exit__(self, *exc):
        for m, w in zip(self.modules, self.saved):
            m.weight.data = w


def _scale_block(block: nn.Module, inputs, arch, model_config, targeted: dict[str, nn.Linear],
                 config: AWQConfig, log: dict) -> None:
    """Search and fold the scales of every scale group of one block (float function kept)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    for group in arch.scale_groups:
        names = [n for n in group.linears if n in targeted]
        if not names:
            continue
        linears = [block.get_submodule(n) for n in group.linears]       # all consumers get scaled
        prev = block.get_submodule(group.prev)
        inspect_name = group.linears[0].rpartition(".")[0] if group.prev_kind == "norm" else group.linears[0]
        inspect = block.get_submodule(inspect_name)
        captured = capture_inputs(block, inputs, {inspect_name: inspect}, with_kwargs=True)[inspect_name]
        captured = _limit_batches(captured, config.search_tokens)
        with torch.no_grad():
            targets = [block_output(inspect(x, **kw)) for x, kw in captured]
        s_x = activation_scale(torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in captured]))
        expand = None
        if group.prev_kind == "linear" and prev.out_features != linears[0].in_features:
            if prev.out_features * heads != linears[0].in_features * kv_heads:
                raise ValueError(f"cannot map {group.prev} ({prev.out_features} outputs) onto "
                                 f"{group.linears} ({linears[0].in_features} inputs)")
            expand, reduce = kv_head_maps(heads, kv_heads, head_dim)
            s_x = reduce(s_x)
        quantized = [targeted.get(n) is not None for n in group.linears]

        def loss_of(cands):
            ws = [c if q else m.weight.data for c, q, m in zip(cands, quantized, linears)]
            total, count = 0.0, 0
            with torch.no_grad(), _SwappedWeights(linears, ws):
                for (x, kw), ref in zip(captured, targets):
                    total += float((block_output(inspect(x, **kw)) - ref).float().pow(2).sum())
                    count += ref.numel()
            return total / count

        group_size = primitives.resolve_group_size(config.group_size, linears[0].in_features)
        s, alpha, losses = search_scale(s_x, [m.weight.data for m in linears], loss_of, group_size,
                                        config.symmetric, config.n_grid,
                                        config.duo_scaling and expand is None, expand)
        if group.prev_kind == "norm":
            fold_scale_into_norm(prev.weight.data, [m.weight.data for m in linears], s)
        else:
            fold_scale_into_linear(prev.weight.data, prev.bias.data if prev.bias is not None else None,
                                   [m.weight.data for m in linears], s, expand(s) if expand else s)
        log.setdefault("alpha", {})[f"{group.prev}->{'/'.join(group.linears)}"] = alpha
        log.setdefault("gain", []).append(losses[0] / max(min(losses), 1e-30))
        del captured, targets


def quantize_weight_awq(weight: torch.Tensor, x: torch.Tensor | None, config: AWQConfig, name: str,
                        clip: bool) -> QuantizedWeight:
    """The per-linear core after scaling: optional clip search, then groupwise int4."""
    primitives.check_finite(weight, name)
    primitives.check_group_size(weight.shape[1], config.group_size, name)
    group_size = primitives.resolve_group_size(config.group_size, weight.shape[1])
    ratio = 1.0
    if clip and x is not None:
        ratio = search_clip(weight, x, group_size, config.symmetric, config.clip_grid, config.max_shrink)
    qw, scales, zeros = primitives.quantize_int4_groupwise(weight, group_size, config.symmetric, ratio)
    return int4_quantized_weight(qw, scales, zeros, weight.shape[1], config.group_size, config.symmetric)


class AWQStep(BlockStep):
    """Per block: search and fold the scales, search the clip ratios, quantize."""
    calibrated = True

    def __init__(self, model, arch, config: AWQConfig, ctx):
        selected = select_linears(model, config.targets, config.ignore, ctx.where)
        super().__init__(*group_by_block([n for n, _ in selected], arch, "awq", ctx.where, allow_outside=False))
        for name, module in selected:      # fail before any calibration work
            primitives.check_group_size(module.in_features, config.group_size, name)
        self.config, self.arch, self.model_config = config, arch, model.config
        self.batch_size = config.batch_size
        self.log: dict = {}

    def block(self, index, block, inputs, record) -> None:
        config, arch, prefix = self.config, self.arch, self.arch.layers
        targeted = {rel: block.get_submodule(rel) for rel in self.per_block[index]}
        for rel, module in targeted.items():
            primitives.check_finite(module.weight.data, f"{prefix}.{index}.{rel}")
        no_clip = {arch.q_proj, arch.k_proj}
        _scale_block(block, inputs, arch, self.model_config, targeted, config, self.log)
        clip_inputs = {}
        if config.clip:
            wanted = {n: m for n, m in targeted.items() if n not in no_clip}
            seen = capture_inputs(block, inputs, wanted)
            clip_inputs = {n: _token_sample(xs, config.clip_tokens) for n, xs in seen.items()}
            del seen
        for rel, module in targeted.items():
            qw = quantize_weight_awq(module.weight.data, clip_inputs.get(rel), config,
                                     f"{prefix}.{index}.{rel}", rel not in no_clip)
            record(f"{prefix}.{index}.{rel}", module, qw)

    def finish(self, stats: dict) -> None:
        stats.setdefault("awq", {}).update(self.log)


def apply_awq(state, config: AWQConfig, ctx) -> None:
    apply_whole_model(AWQStep(state.model, state.arch, config, ctx), state, ctx)
