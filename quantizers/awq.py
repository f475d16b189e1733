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

One forward of the block catches everything the searches need (each inspected module's
inputs, the attention / MLP outputs, the clip linears' inputs): folding keeps the float
function, so nothing a later group sees changes when an earlier group's scales are folded.
A group whose inspected module is one linear scores a candidate ``W'`` as the mean of
``(x (W' - W)^T)^2``, through the inputs' Gram matrix ``X^T X`` when that is cheaper.

Then the scaled block's linears get a per-(row, group) clip search (q/k are skipped, as
clipping them distorts attention scores; errors through each group's Gram matrix, the
inputs being the caught ones divided by the scales folded into the linear) and are quantized with
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
from quantizers.awq_search import (fold_scale_into_linear, fold_scale_into_norm, kv_head_maps, search_clip,
                                   search_scale)
from quantizers.block_capture import capture_inputs_outputs
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
    """``tokens`` rows spread evenly over all captured tokens (deterministic), gathered
    batch by batch (the same rows as indexing their concatenation, without making it)."""
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    total = sum(f.shape[0] for f in flat)
    if total <= tokens:
        return torch.cat(flat)
    index = torch.linspace(0, total - 1, tokens).long()
    rows, start = [], 0
    for f in flat:
        mine = index[(index >= start) & (index < start + f.shape[0])]
        rows.append(f[mine - start])
        start += f.shape[0]
    return torch.cat(rows)


def _mean_abs(xs: list[torch.Tensor]) -> torch.Tensor:
    """:func:`activation_scale` over several batches, without concatenating them."""
    total, count = None, 0
    for x in xs:
        flat = x.reshape(-1, x.shape[-1])
        part = flat.abs().sum(dim=0, dtype=torch.float32)
        total = part if total is None else total.add_(part)
        count += flat.shape[0]
    return total / count


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


def _module_loss(inspect: nn.Module, linears: list[nn.Linear], quantized: list[bool], captured: list,
                 targets: list[torch.Tensor]):
    """``loss_of`` for a group whose inspected module is an attention or MLP: rerun it on
    the captured inputs with the candidate weights swapped in, mean squared error against
    its float outputs."""
    count = sum(t.numel() for t in targets)

    def loss_of(cands):
        ws = [c if q else m.weight.data for c, q, m in zip(cands, quantized, linears)]
        total = 0.0
        with torch.no_grad(), _SwappedWeights(linears, ws):
            for (x, kw), ref in zip(captured, targets):
                out = block_output(inspect(x, **kw))
                total += float(torch.nn.functional.mse_loss(out.float(), ref.float(), reduction="sum"))
        return total / count
    return loss_of


def _linear_loss(linear: nn.Linear, xs: list[torch.Tensor], n_grid: int, quantized: bool):
    """``loss_of`` for a group whose inspected module is the linear itself: the mean of
    ``(x (W' - W)^T)^2`` over tokens and outputs (the bias cancels). When the inputs have
    more tokens than the linear's input channels allow to pay off, through their Gram
    matrix ``H = X^T X``: ``sum((D H) * D)``, whatever the number of tokens."""
    if not quantized:                    # the inspected linear keeps its float weight
        return lambda cands: 0.0
    weight = linear.weight.data.to(torch.float32)
    n, k = weight.shape
    tokens = sum(x[..., 0].numel() for x in xs)
    count = tokens * n
    if tokens * k * k + n_grid * n * k * k < n_grid * tokens * n * k:
        gram = torch.zeros(k, k)
        for x in xs:
            flat = x.reshape(-1, k).to(torch.float32)
            gram.addmm_(flat.t(), flat)

        def loss_of(cands):
            d = cands[0] - weight
            return float((d @ gram).mul_(d).sum()) / count
        return loss_of

    def loss_of(cands):
        d = cands[0] - weight
        total = 0.0
        with torch.no_grad():
            for x in xs:
                total += float(torch.nn.functional.linear(x.to(torch.float32), d).pow_(2).sum())
        return total / count
    return loss_of


def _scale_block(block: nn.Module, inputs, arch, model_config, targeted: dict[str, nn.Linear],
                 config: AWQConfig, log: dict, clip_names: list[str], where: str = "") -> dict[str, torch.Tensor]:
    """Search and fold the scales of every scale group of one block (float function kept);
    returns the clip search's token sample of each of ``clip_names``' inputs, as the scaled
    block feeds it. The chosen alphas are logged under ``where`` + the group's names.

    One forward of the block catches everything: each group's inspected-module inputs (and,
    for attention / MLP, outputs) and the clip linears' inputs. Folding keeps the float
    function, so what a later group's module receives does not change when an earlier
    group's scales are folded, and a linear whose input columns were multiplied by ``s``
    now receives ``x / s``: the clip sample is divided by the scales folded into its columns."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    plans = []
    for group in arch.scale_groups:
        if not any(n in targeted for n in group.linears):
            continue
        module_inspected = group.prev_kind == "norm"
        inspect_name = group.linears[0].rpartition(".")[0] if module_inspected else group.linears[0]
        plans.append((group, inspect_name, module_inspected))
    watched = {name: block.get_submodule(name) for name in
               dict.fromkeys([p[1] for p in plans] + list(clip_names))}
    with_kwargs = {name for _, name, module_inspected in plans if module_inspected}
    seen, made = capture_inputs_outputs(block, inputs, watched, with_kwargs, with_kwargs)
    clip_x = {n: _token_sample(seen[n], config.clip_tokens) for n in clip_names}
    seen = {name: seen[name] for _, name, _ in plans}          # the rest was for the clip sample
    col_scale: dict[str, torch.Tensor] = {}

    for group, inspect_name, module_inspected in plans:
        linears = [block.get_submodule(n) for n in group.linears]       # all consumers get scaled
        prev = block.get_submodule(group.prev)
        inspect = block.get_submodule(inspect_name)
        captured = _limit_batches(seen.pop(inspect_name), config.search_tokens)
        xs = [c[0] for c in captured] if module_inspected else captured
        s_x = _mean_abs(xs)
        expand = None
        if group.prev_kind == "linear" and prev.out_features != linears[0].in_features:
            if prev.out_features * heads != linears[0].in_features * kv_heads:
                raise ValueError(f"cannot map {group.prev} ({prev.out_features} outputs) onto "
                                 f"{group.linears} ({linears[0].in_features} inputs)")
            expand, reduce = kv_head_maps(heads, kv_heads, head_dim)
            s_x = reduce(s_x)
        quantized = [targeted.get(n) is not None for n in group.linears]
        if module_inspected:
            targets = made.pop(inspect_name)[:len(captured)]
            loss_of = _module_loss(inspect, linears, quantized, captured, targets)
        else:
            loss_of = _linear_loss(inspect, xs, config.n_grid, quantized[0])

        group_size = primitives.resolve_group_size(config.group_size, linears[0].in_features)
        s, alpha, losses = search_scale(s_x, [m.weight.data for m in linears], loss_of, group_size,
                                        config.symmetric, config.n_grid,
                                        config.duo_scaling and expand is None, expand)
        s_in = expand(s) if expand else s
        if group.prev_kind == "norm":
            fold_scale_into_norm(prev.weight.data, [m.weight.data for m in linears], s)
        else:
            fold_scale_into_linear(prev.weight.data, prev.bias.data if prev.bias is not None else None,
                                   [m.weight.data for m in linears], s, s_in)
        for n in group.linears:
            col_scale[n] = col_scale[n] * s_in if n in col_scale else s_in
        log.setdefault("alpha", {})[f"{where}{group.prev}->{'/'.join(group.linears)}"] = alpha
        log.setdefault("gain", []).append(losses[0] / max(min(losses), 1e-30))
        del captured, xs, loss_of
    return {n: x / col_scale[n].to(x.dtype) if n in col_scale else x for n, x in clip_x.items()}


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
        clip_names = [n for n in targeted if n not in no_clip] if config.clip else []
        clip_inputs = _scale_block(block, inputs, arch, self.model_config, targeted, config, self.log,
                                   clip_names, f"{prefix}.{index}.")
        for rel, module in targeted.items():
            qw = quantize_weight_awq(module.weight.data, clip_inputs.get(rel), config,
                                     f"{prefix}.{index}.{rel}", rel not in no_clip)
            record(f"{prefix}.{index}.{rel}", module, qw)

    def finish(self, stats: dict) -> None:
        stats.setdefault("awq", {}).update(self.log)


def apply_awq(state, config: AWQConfig, ctx) -> None:
    apply_whole_model(AWQStep(state.model, state.arch, config, ctx), state, ctx)
