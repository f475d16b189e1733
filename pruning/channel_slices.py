"""What a structured cut keeps: the pure core of width pruning.

An architecture's channel groups (``ArchSpec.channel_groups``, compress/architectures.py)
say which tensors share an index space: an MLP channel is rows of gate/up and a column
of down; a query head is head_dim rows of q and columns of o (and its kv head's rows of
k/v once no query head of that group is left); a hidden channel is a column of the
embedding and of every linear reading the residual stream, a row of every linear writing
it and an entry of every norm. Given a model config and the indices kept for one group,
:func:`plan_channel_cut` lists every ``(tensor, dim, index)`` slice to apply and the
config keys that change; :func:`apply_slices` applies them to a mapping of tensors and
:func:`smaller_config` builds the new config. No model, no files: the prune method
chooses the indices, this says what they mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch

from compress.architectures import ArchSpec, ChannelGroup, ChannelMember


class TensorSlice(NamedTuple):
    name: str                 # the tensor's full name in the checkpoint
    dim: int
    index: torch.Tensor       # kept positions along ``dim``, ascending, int64


@dataclass(frozen=True)
class ChannelCut:
    group: str
    slices: tuple[TensorSlice, ...]
    config: dict              # the config keys the cut changes, with their new values


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a llama-family config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def plan_channel_cut(arch: ArchSpec, config, group: str, kept) -> ChannelCut:
    """The slices and config changes that keep ``kept`` of channel group ``group``.

    ``kept``: ascending indices into the group's index space -- intermediate channels
    ('mlp_channel'), query heads ('query_head') or hidden channels ('hidden_channel').
    Per-block groups take one row per decoder block (``[num_hidden_layers, k]``: every
    block keeps k, which ones may differ) or one row for every block; the hidden group
    takes one row (``[k]``), the residual stream being one. A ValueError names what is wrong.
    """
    spec = arch.channel_group(group)
    _refuse_unlisted_biases(arch, config, spec.kind)
    heads, kv_heads, head_dim = attention_shape(config)
    layers = config.num_hidden_layers
    if spec.kind == "mlp_channel":
        rows = _check_kept(kept, config.intermediate_size, layers, group)
        units = {"channel": rows}
        changes = {"intermediate_size": rows.shape[1]}
    elif spec.kind == "query_head":
        rows = _check_kept(kept, heads, layers, group)
        kv_rows = _kept_kv_heads(rows, heads, kv_heads, group)
        units = {"query_head": _expand_heads(rows, head_dim), "kv_head": _expand_heads(kv_rows, head_dim)}
        changes = {"num_attention_heads": rows.shape[1], "num_key_value_heads": kv_rows.shape[1],
                   "head_dim": head_dim}
    elif spec.kind == "hidden_channel":
        row = _check_kept(kept, config.hidden_size, None, group)
        rows = row.expand(layers, -1)
        units = {"channel": rows}
        changes = {"hidden_size": row.shape[1], "head_dim": head_dim}
    else:
        raise ValueError(f"{arch.model_type}: channel group {group!r} has unknown kind {spec.kind!r}")
    return ChannelCut(group, tuple(_slices(arch, config, spec, units)), changes)


def _slices(arch: ArchSpec, config, spec: ChannelGroup, units: dict[str, torch.Tensor]):
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for member in spec.members:
        if member.tied_to is not None and tied:
            continue                      # the same tensor as ``tied_to``, cut there
        index = _unit_rows(member, units, arch, spec)
        if member.scope == "model":
            if spec.kind != "hidden_channel":
                raise ValueError(f"{arch.model_type}: channel group {spec.name!r} is chosen per block, "
                                 f"but lists {member.tensor!r} outside the blocks")
            yield TensorSlice(member.tensor, member.axis, index[0].clone())
        else:
            for block in range(config.num_hidden_layers):
                yield TensorSlice(f"{arch.block_prefix(block)}.{member.tensor}", member.axis, index[block].clone())


def _unit_rows(member: ChannelMember, units: dict[str, torch.Tensor], arch: ArchSpec,
               spec: ChannelGroup) -> torch.Tensor:
    if member.unit not in units:
        raise ValueError(f"{arch.model_type}: channel group {spec.name!r} ({spec.kind}) lists "
                         f"{member.tensor!r} with unit {member.unit!r}, which that kind has no index for")
    return units[member.unit]


def _check_kept(kept, size: int, layers: int | None, group: str) -> torch.Tensor:
    """``kept`` as an int64 ``[layers, k]`` tensor (``[1, k]`` for a model-wide group)."""
    t = torch.as_tensor(kept)
    if t.numel() == 0:
        raise ValueError(f"{group}: keeps nothing; keep at least one of {size}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{group}: kept indices must be integers, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if layers is None:
        if t.dim() != 1:
            raise ValueError(f"{group}: kept indices must be one row [k] (one choice for every block), "
                             f"got shape {list(t.shape)}")
        t = t.unsqueeze(0)
    elif t.dim() == 1:
        t = t.unsqueeze(0).expand(layers, -1)
    elif t.dim() != 2 or t.shape[0] != layers:
        raise ValueError(f"{group}: kept indices must be [k] or one row per block [{layers}, k], "
                         f"got shape {list(t.shape)}")
    if int(t.min()) < 0 or int(t.max()) >= size:
        raise ValueError(f"{group}: kept indices must lie in [0, {size}), got {int(t.min())}..{int(t.max())}")
    if (t.diff(dim=1) <= 0).any():
        row = int((t.diff(dim=1) <= 0).any(dim=1).nonzero()[0])
        raise ValueError(f"{group}: kept indices must be strictly increasing; "
                         f"row {row} is {t[row].tolist()}")
    return t


def _kept_kv_heads(rows: torch.Tensor, heads: int, kv_heads: int, group: str) -> torch.Tensor:
    """The kv heads left per block: those with a kept query head. Transformers shares one
    number of query heads per kv head across the model, so every kept kv head must keep
    the same number of query heads, and every block the same number of kv heads."""
    per_kv = heads // kv_heads
    kept_kv = []
    for block, row in enumerate(rows):
        kv, counts = torch.unique_consecutive(row // per_kv, return_counts=True)
        if (counts != counts[0]).any():
            raise ValueError(f"{group}: block {block} keeps query heads {row.tolist()}, i.e. "
                             f"{counts.tolist()} of the {per_kv} query heads of kv heads {kv.tolist()}; "
                             "every kept kv head must keep the same number of query heads")
        kept_kv.append(kv)
    sizes = {len(kv) for kv in kept_kv}
    if len(sizes) > 1:
        raise ValueError(f"{group}: blocks keep different numbers of kv heads "
                         f"({[len(kv) for kv in kept_kv]}); the config has one num_key_value_heads")
    return torch.stack(kept_kv)


def _expand_heads(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Head indices ``[layers, k]`` -> their rows ``[layers, k * head_dim]``."""
    offsets = torch.arange(head_dim, dtype=torch.int64)
    return (rows.unsqueeze(-1) * head_dim + offsets).flatten(1)


# which bias flags a cut of each kind reaches: attention_bias puts biases on q / k / v
# (query and kv head rows) and o_proj (hidden rows); mlp_bias on gate / up (MLP channel
# rows) and down_proj (hidden rows)
_BIASES_REACHED = {"mlp_channel": ("mlp_bias",), "query_head": ("attention_bias",),
                   "hidden_channel": ("attention_bias", "mlp_bias")}


def _refuse_unlisted_biases(arch: ArchSpec, config, kind: str) -> None:
    flags = [k for k in _BIASES_REACHED.get(kind, ("attention_bias", "mlp_bias")) if getattr(config, k, False)]
    if flags:
        raise ValueError(f"{arch.model_type}: config sets {', '.join(flags)}; the channel table "
                         f"(compress/architectures.py) does not list those biases, so cutting would miss them")


def apply_slices(tensors: Mapping[str, torch.Tensor], slices) -> dict[str, torch.Tensor]:
    """``tensors`` with every slice applied (contiguous copies); the others as they are.
    A slice naming an absent tensor, or an index past its size, is an error naming it."""
    out = dict(tensors)
    for s in slices:
        if s.name not in out:
            raise KeyError(f"no tensor {s.name!r} to slice (a tied lm_head is stored as the embedding)")
        t = out[s.name]
        if s.dim >= t.dim() or (s.index.numel() and int(s.index.max()) >= t.shape[s.dim]):
            raise ValueError(f"tensor {s.name!r} of shape {list(t.shape)} cannot keep "
                             f"{s.index.numel()} indices up to {int(s.index.max())} on dim {s.dim}")
        out[s.name] = t.index_select(s.dim, s.index).contiguous()
    return out


def smaller_config(config, changes: Mapping[str, int]):
    """A new config of the same class with ``changes`` applied (validated by its class); a
    ValueError carrying the class's reason when it refuses them (transformers 5's config
    validators raise their own exception types)."""
    try:
        return type(config).from_dict({**config.to_dict(), **changes})
    except Exception as exc:  # noqa: BLE001 - whatever the class's validator raises
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{type(config).__name__} refuses {dict(changes)}: {reason}") from None
