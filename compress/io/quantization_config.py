"""Which quantized checkpoints the runtime and the pipeline read: a config.json's
``quantization_config`` checked before any tensor is, so a scheme the runtime would not
compute as the checkpoint means it is refused by name (file, config group, scheme)
instead of read as a near one."""
from __future__ import annotations

from pathlib import Path

from compress.io.errors import CheckpointError

SUPPORTED_CT_FORMATS = {"pack-quantized", "int-quantized", "naive-quantized", "mixed-precision", "dense"}


def _check_ct_group(name: str, group: dict, weights: dict, fmt: str | None, cfile: Path) -> None:
    """The compressed-tensors schemes the runtime computes as their checkpoints mean them:
    W4A16 (4-bit weights packed 8 to an int32, per group or channel, float activations) and
    W8A8 (int8 weights per channel, int8 activations quantized per token at run time). Any
    other combination is refused by name, not read as one of these: a W8A16 checkpoint
    read as W8A8 would run with int8 activations it does not ask for."""
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    acts = group.get("input_activations")
    where = f"{cfile}: config group {name!r}"
    if bits == 4:
        if fmt not in (None, "pack-quantized"):
            raise CheckpointError(f"{where}: 4-bit weights in format {fmt!r}; only pack-quantized (W4A16) is read")
        if strategy not in (None, "group", "channel"):
            raise CheckpointError(f"{where}: 4-bit weights by strategy {strategy!r}; only group and channel are read")
        if acts:
            raise CheckpointError(f"{where}: 4-bit weights with {acts.get('num_bits')}-bit activations (W4A8) are "
                                  "not supported; W4A16 (input_activations null) is")
    else:
        if fmt == "pack-quantized":
            raise CheckpointError(f"{where}: 8-bit weights packed (pack-quantized, W8A16) are not supported; W8A8 "
                                  "(int-quantized, int8 per-token activations) is")
        if strategy not in (None, "channel"):
            raise CheckpointError(f"{where}: 8-bit weights by strategy {strategy!r}; only per channel (W8A8) is read")
        if not acts:
            raise CheckpointError(f"{where}: 8-bit weights with float activations (W8A16) are not supported: the "
                                  "runtime's int8 kernels quantize activations, which this checkpoint does not ask for")
        if acts.get("num_bits") != 8 or acts.get("type") != "int" or not acts.get("dynamic") \
                or acts.get("strategy") not in (None, "token"):
            raise CheckpointError(f"{where}: activations {acts.get('num_bits')}-bit {acts.get('type')} "
                                  f"{'dynamic' if acts.get('dynamic') else 'static'} by {acts.get('strategy')!r}; "
                                  "only int8 quantized per token at run time (dynamic) is read")


def check_quantization_config(qc: dict | None, cfile: Path) -> None:
    if not qc:
        return
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        fmts = {fmt} | {g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")}
        bad = sorted(str(f) for f in fmts - SUPPORTED_CT_FORMATS)
        if bad:
            raise CheckpointError(f"{cfile}: compressed-tensors format(s) {bad} not supported; "
                                  f"supported: {sorted(SUPPORTED_CT_FORMATS)}")
        status = qc.get("quantization_status")
        if status not in (None, "compressed"):
            raise CheckpointError(f"{cfile}: quantization_status {status!r}: only compressed checkpoints are read "
                                  "(a frozen one holds float weights beside their scales; compress them first)")
        if qc.get("sparsity_config"):
            raise CheckpointError(f"{cfile}: sparsity_config {(qc['sparsity_config'] or {}).get('format')!r}: "
                                  "sparse compressed-tensors checkpoints are not supported")
        for name, g in groups.items():
            w = (g or {}).get("weights") or {}
            if w and (w.get("type") != "int" or w.get("num_bits") not in (4, 8)):
                raise CheckpointError(f"{cfile}: config group {name!r} quantizes weights to "
                                      f"{w.get('num_bits')}-bit {w.get('type')}; only int4 / int8 are supported")
            if w:
                _check_ct_group(name, g, w, (g or {}).get("format") or fmt, cfile)
    elif method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            raise CheckpointError(f"{cfile}: bitsandbytes 4-bit checkpoints are not supported (only LLM.int8)")
    elif method != "compress":
        raise CheckpointError(f"{cfile}: quantization method {method!r} is not supported "
                              "(supported: compressed-tensors int4/int8, bitsandbytes int8, compress)")
