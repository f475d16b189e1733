"""Calibration data, and layer-by-layer activation capture.

``load_calibration_ids`` turns text files, jsonl files or (online) a Hugging Face
dataset into a fixed, seeded ``[samples, seq_len]`` tensor of token ids.

``iterate_blocks`` runs the calibration set through the model one decoder block at a
time, so peak memory stays near one block plus the hidden states of the calibration
set, never the whole model's activations: the caller gets each block with its
inputs, may change the block (quantize, scale, prune), and the *changed* block's
outputs become the next block's inputs, as in GPTQ/AWQ.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from compress.architectures import ArchSpec
from compress.errors import UserError


class CalibrationError(UserError):
    pass


def _read_texts(path: Path, field: str) -> list[str]:
    if not path.is_file():
        raise CalibrationError(f"calibration file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if path.suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise CalibrationError(f"{path}:{lineno}: record has no field {field!r}")
            texts.append(str(record[field]))
        return texts
    return [text]


def _dataset_texts(spec: str, field: str) -> list[str]:
    """``name[:config]:split`` from the Hugging Face hub (needs network)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise CalibrationError(f"dataset spec must be 'name[:config]:split', got {spec!r}")
    import datasets
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name, ...
        raise CalibrationError(f"could not load dataset {spec!r}: {exc}") from None
    if field not in ds.column_names:
        raise CalibrationError(f"dataset {spec!r} has no column {field!r}; columns: {ds.column_names}")
    return [t for t in ds[field] if t]


def load_calibration_ids(files: list[str], tokenizer, samples: int, seq_len: int, seed: int,
                         field: str = "text", dataset: str | None = None) -> torch.Tensor:
    """Seeded random windows of ``seq_len`` tokens from the concatenated documents."""
    texts: list[str] = []
    for f in files:
        texts.extend(_read_texts(Path(f), field))
    if dataset:
        texts.extend(_dataset_texts(dataset, field))
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError("the calibration set is empty: give non-empty 'files' or a 'dataset'")
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    stream = torch.tensor(ids, dtype=torch.long)
    if stream.numel() < seq_len + 1:
        raise CalibrationError(f"calibration text has {stream.numel()} tokens, fewer than seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len, (samples,), generator=gen)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


class _StopForward(Exception):
    pass


@dataclass
class BlockInputs:
    """The inputs of one decoder block for the whole calibration set."""
    hidden: list[torch.Tensor]          # one [batch, T, H] tensor per calibration batch
    kwargs: dict                        # shared keyword args (position embeddings, mask, ...)
    # where config.layer_types mixes kinds (Qwen2 / Qwen3 with use_sliding_window and
    # max_window_layers): each kind's attention mask and each layer's kind, since the
    # model gives a sliding layer another mask than the full one block 0 received
    masks: dict | None = None
    layer_types: list | None = None

    def kwargs_for(self, block: nn.Module) -> dict:
        """The keyword arguments ``block`` gets in the model's own forward."""
        if not self.masks:
            return self.kwargs
        index = next((m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)
        if index is None or index >= len(self.layer_types):
            raise CalibrationError("calibration: config.layer_types mixes attention kinds, and a decoder block "
                                   "does not say which layer it is (no layer_idx)")
        return {**self.kwargs, "attention_mask": self.masks[self.layer_types[index]]}

    def with_hidden(self, hidden: list[torch.Tensor]) -> "BlockInputs":
        return BlockInputs(hidden, self.kwargs, self.masks, self.layer_types)


def block_output(out):
    """A decoder block's hidden states, whether it returns them alone or in a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


def capture_first_block_inputs(model: nn.Module, arch: ArchSpec, input_ids: torch.Tensor,
                               batch_size: int = 8, embed=None) -> BlockInputs:
    """Run the embedding only, catching what the first decoder block receives.
    ``embed(ids) -> [batch, T, H]``, when given, replaces the model's embedding module
    (which may then sit on the ``meta`` device)."""
    blocks = model.get_submodule(arch.layers)
    first = blocks[0]
    hidden, kwargs_seen = [], {}

    def hook(_module, args, kwargs):
        hidden.append(args[0] if args else kwargs["hidden_states"])
        kwargs_seen.update({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _StopForward

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(0, input_ids.shape[0], batch_size):
                batch = input_ids[i:i + batch_size]
                try:
                    if embed is None:
                        model(batch, use_cache=False)
                    else:
                        model(inputs_embeds=embed(batch), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
    kwargs_seen.pop("past_key_values", None)
    kwargs_seen.pop("past_key_value", None)
    kwargs_seen["use_cache"] = False
    layer_types = list(getattr(model.config, "layer_types", None) or [])
    masks = _masks_by_layer_type(model.config, layer_types, hidden[0], kwargs_seen) \
        if hidden and len(set(layer_types)) > 1 else None
    return BlockInputs(hidden, kwargs_seen, masks, layer_types if masks else None)


def _masks_by_layer_type(config, layer_types: list, hidden: torch.Tensor, kwargs: dict) -> dict:
    """Each attention kind's mask over one calibration row (it broadcasts over a batch), made
    as the model's forward makes it; block 0's captured mask is only its own kind's."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    unknown = sorted(set(layer_types) - set(makers))
    if unknown:
        raise CalibrationError(f"calibration: config.layer_types names attention kinds {unknown} that compress "
                               f"does not know (it knows {sorted(makers)})")
    row = torch.zeros((1,) + tuple(hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return {kind: makers[kind](config=config, inputs_embeds=row, attention_mask=None, past_key_values=None,
                               position_ids=position_ids[:1]) for kind in set(layer_types)}


def run_block(block: nn.Module, inputs: BlockInputs) -> list[torch.Tensor]:
    kwargs = inputs.kwargs_for(block)
    with torch.no_grad():
        return [block_output(block(h, **kwargs)) for h in inputs.hidden]


def _check_finite(tensors: list[torch.Tensor], where: str) -> None:
    for t in tensors:
        if not torch.isfinite(t).all():
            raise CalibrationError(f"NaN/Inf in calibration activations {where}; "
                                   "check the model weights and the calibration text")


def iterate_blocks(model: nn.Module, arch: ArchSpec, input_ids: torch.Tensor,
                   batch_size: int = 8) -> Iterator[tuple[int, nn.Module, BlockInputs]]:
    """Yield ``(index, block, inputs)`` for each decoder block in order.

    After the consumer resumes the generator, the (possibly modified) block is run on
    ``inputs`` to produce the next block's inputs. Only one block's activations are
    alive at a time.
    """
    inputs = capture_first_block_inputs(model, arch, input_ids, batch_size)
    _check_finite(inputs.hidden, "at the input of block 0")
    blocks = model.get_submodule(arch.layers)
    for index, block in enumerate(blocks):
        yield index, block, inputs
        inputs = advance(block, inputs, index, arch)


def advance(block: nn.Module, inputs: BlockInputs, index: int, arch: ArchSpec) -> BlockInputs:
    """The next block's inputs: block ``index`` run on ``inputs``, checked for NaN/Inf."""
    outputs = run_block(block, inputs)
    _check_finite(outputs, f"at the output of block {index} ({arch.block_prefix(index)})")
    return inputs.with_hidden(outputs)
