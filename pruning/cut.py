"""Cutting a model to the kept blocks and channels, one tensor at a time.

:func:`plan_cut` turns the kept indices (blocks, MLP channels, query heads, hidden
channels) into the slices of every tensor, named as in the smaller model (blocks
renumbered), and that model's config. :func:`stream_cut` reads each tensor of the source
in turn, slices it and hands it to the writer, so memory holds one tensor (and its
slices), not the model; then every written shape is checked against the module tree
the new config builds (on ``meta``), so a config that does not describe the tensors is
an error naming the tensor, not a checkpoint that fails to load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from compress.architectures import ArchSpec
from pruning.channel_slices import plan_channel_cut, smaller_config


@dataclass
class KeptIndices:
    """What a prune keeps; None keeps all. Per-block rows follow the kept blocks' order."""
    blocks: torch.Tensor | None = None      # [k] original block indices, ascending
    mlp: torch.Tensor | None = None         # [kept blocks, intermediate kept]
    heads: torch.Tensor | None = None       # [kept blocks, query heads kept]
    hidden: torch.Tensor | None = None      # [hidden kept]


@dataclass
class CutPlan:
    config: object                                   # the smaller model's config
    renamed: dict[int, int]                          # original block index -> new index (kept blocks)
    slices: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)   # new name -> (dim, index)


def depth_config(config, blocks: torch.Tensor):
    """``config`` with only ``blocks`` (ascending original indices) left; per-layer lists
    (``layer_types``: full or sliding attention) follow the kept blocks."""
    changes: dict = {"num_hidden_layers": int(blocks.numel())}
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == config.num_hidden_layers:
        kept = [layer_types[i] for i in blocks.tolist()]
        changes["layer_types"] = kept
        if getattr(config, "use_sliding_window", False) and isinstance(getattr(config, "max_window_layers", None), int):
            # Qwen2 / Qwen3's older field: layers from max_window_layers on slide. Kept true
            # for readers that know only it (the kept types' leading full layers; exact when
            # the kept types are full ones then sliding ones, as a source made by it is)
            changes["max_window_layers"] = next((i for i, t in enumerate(kept) if t != "full_attention"), len(kept))
    return smaller_config(config, changes), changes


def plan_cut(arch: ArchSpec, config, kept: KeptIndices) -> CutPlan:
    layers = config.num_hidden_layers
    blocks = kept.blocks if kept.blocks is not None else torch.arange(layers)
    changes: dict = {}
    if kept.blocks is not None:
        config_d, changes = depth_config(config, blocks)
    else:
        config_d = config
    slices: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for group, index in (("mlp", kept.mlp), ("attention_heads", kept.heads), ("hidden", kept.hidden)):
        if index is None:
            continue
        cut = plan_channel_cut(arch, config_d, group, index)
        changes.update(cut.config)
        for s in cut.slices:
            slices.setdefault(s.name, []).append((s.dim, s.index))
    new_config = smaller_config(config, changes) if changes else config
    return CutPlan(new_config, {int(b): j for j, b in enumerate(blocks.tolist())}, slices)


def new_name(arch: ArchSpec, name: str, renamed: dict[int, int]) -> str | None:
    """``name`` in the smaller model: a block's tensor renumbered, None when its block goes."""
    m = re.match(rf"^{re.escape(arch.layers)}\.(\d+)\.(.+)$", name)
    if m is None:
        return name
    j = renamed.get(int(m.group(1)))
    return None if j is None else f"{arch.block_prefix(j)}.{m.group(2)}"


def stream_cut(source, arch: ArchSpec, plan: CutPlan, writer, trust_remote_code: bool = False) -> dict[str, list]:
    """Every tensor of ``source`` sliced by ``plan`` into ``writer``; returns the shapes
    written. A planned slice of a tensor the source lacks, or a written shape the new
    config does not build, is a ValueError naming the tensor."""
    pending = dict(plan.slices)
    written: dict[str, list] = {}
    tied_head = (f"{arch.lm_head}.weight" if getattr(plan.config, "tie_word_embeddings", False)
                 and f"{arch.embed_tokens}.weight" in source else None)
    for name in source.names():
        target = new_name(arch, name, plan.renamed)
        if target is None or name == tied_head:     # a tied head stored twice: the embedding is it
            continue
        t = source.weight(name)
        for dim, index in pending.pop(target, ()):
            if dim >= t.dim() or int(index.max()) >= t.shape[dim]:
                raise ValueError(f"tensor {name!r} of shape {list(t.shape)} cannot keep indices up to "
                                 f"{int(index.max())} on dim {dim}")
            t = t.index_select(dim, index)
        writer.add_dense(target, t.contiguous())
        written[target] = list(t.shape)
        del t
    if pending:
        raise ValueError(f"the cut slices tensor(s) the source does not hold: {', '.join(sorted(pending)[:4])}")
    check_shapes(plan.config, written, trust_remote_code)
    return written


def check_shapes(config, written: dict[str, list], trust_remote_code: bool = False) -> None:
    """Every parameter of the module tree ``config`` builds has a written tensor of its
    shape (a tied head is the embedding)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    for name, param in model.named_parameters():          # tied parameters once, by their first name
        if name not in written:
            raise ValueError(f"the pruned model's config builds {name!r}, which the cut did not write")
        if written[name] != list(param.shape):
            raise ValueError(f"tensor {name!r} was cut to {written[name]}, but the pruned model's config "
                             f"({type(config).__name__}) builds it as {list(param.shape)}")


def planned_shapes(arch: ArchSpec, shapes: dict[str, list], plan: CutPlan) -> dict[str, list]:
    """The shapes :func:`stream_cut` writes, from the source's shapes alone (no data):
    what lets a prune check its plan against the new config before any work."""
    out = {}
    for name, shape in shapes.items():
        target = new_name(arch, name, plan.renamed)
        if target is None:
            continue
        shape = list(shape)
        for dim, index in plan.slices.get(target, ()):
            shape[dim] = int(index.numel())
        out[target] = shape
    missing = sorted(set(plan.slices) - set(out))
    if missing:
        raise ValueError(f"the cut slices tensor(s) the model does not hold: {', '.join(missing[:4])}")
    return out
