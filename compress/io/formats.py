"""On-disk tensor formats: canonical ``QuantizedWeight`` tensors <-> checkpoint tensors
(the whole checkpoint format, manifest included: ``compress/io/FORMAT.md``).

One codec per weight scheme, each following an ecosystem format so that other tools
can read what we write:

* ``w4a16`` -> compressed-tensors ``pack-quantized``::

      <m>.weight_packed      int32 [N, ceil(K/8)]  nibble k%8 of word k//8 = q + 8 (same as ours)
      <m>.weight_scale       [N, K/g]         scale dtype as quantized
      <m>.weight_shape       int64 [2]        (N, K)
      <m>.weight_zero_point  int32 [ceil(N/8), K/g]  asymmetric only

  Per channel (``strategy: channel``, ``group_size: null`` in the config group) is the
  same tensors with one group per row (``weight_scale`` [N, 1]), for any K: when
  K % 8 != 0 the last word's unused nibbles are 0, as ``pack_to_int32`` pads them, and
  ``weight_shape`` gives the true K.

  The zero point is stored the way ``compressed_tensors.compressors.pack_quantized``
  writes it: signed (``z - 8``), offset back by +8 and packed 8 per int32 along dim 0
  (the output-channel dim), i.e. nibble ``n % 8`` of word ``[n // 8, j]`` holds our
  unsigned ``zeros[n, j]``. When every zero is 8 the layer is symmetric and the zero
  point is not written (``symmetric: true`` in its config group).

  An export with asymmetric int4 layers carries ``"dequantize": true`` in its
  ``quantization_config`` so transformers + compressed-tensors load it (why: FORMAT.md).

* ``w8a8`` -> compressed-tensors ``int-quantized``: ``<m>.weight`` int8 [N, K],
  ``<m>.weight_scale`` [N, 1]; weights int8 channel symmetric, input activations dynamic
  per-token int8.

* ``llm_int8`` -> bitsandbytes ``Linear8bitLt`` serialization: ``<m>.weight`` int8
  [N, K], ``<m>.SCB`` fp32 [N] (row absmax, so ``scale = SCB / 127``),
  ``<m>.weight_format`` uint8 scalar 0 ("row"), plus ours: ``<m>.outlier_idx`` int64
  [C] and ``<m>.outlier_weight`` [N, C].

Scheme detection on load is by tensor names only (``weight_packed`` -> w4a16, ``SCB``
-> llm_int8, int8 ``weight`` + ``weight_scale`` -> w8a8), so a checkpoint written by
another tool in these formats loads without our manifest.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from compress.io.schemes import QuantizedWeight
from compress.errors import UserError

FORMAT_NAME = "compress-checkpoint"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)


class CheckpointFormatError(UserError):
    """A checkpoint's tensors do not form a valid layer of the scheme they claim."""


# ---------------------------------------------------------------- zero-point packing

def pack_int4_dim0(values: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, G]`` nibbles (0..15) -> int32 ``[ceil(N/8), G]``, 8 rows per word."""
    n, g = values.shape
    pad = (-n) % 8
    v = values.to(torch.int64)
    if pad:
        v = torch.cat([v, torch.zeros(pad, g, dtype=torch.int64)], dim=0)
    v = v.reshape(-1, 8, g)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64).view(1, 8, 1)
    words = (v << shifts).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def unpack_int4_dim0(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 ``[ceil(N/8), G]`` -> uint8 ``[N, G]`` (inverse of :func:`pack_int4_dim0`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    nib = (packed.to(torch.int32).unsqueeze(1) >> shifts) & 0xF
    return nib.reshape(-1, packed.shape[1])[:rows].to(torch.uint8).contiguous()


# ---------------------------------------------------------------- codecs

@dataclass(frozen=True)
class SchemeCodec:
    scheme: str
    required: tuple[str, ...]      # local tensor names that must be present
    optional: tuple[str, ...] = ()

    def encode(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode(self, local: dict[str, torch.Tensor], meta: dict, where: str) -> QuantizedWeight:
        raise NotImplementedError


def _need(t: dict, key: str, where: str) -> torch.Tensor:
    if key not in t:
        raise CheckpointFormatError(f"missing tensor '{where}.{key}'")
    return t[key]


class W4A16Codec(SchemeCodec):
    def encode(self, qw):
        t = qw.tensors
        qweight, scales, zeros = t["qweight"], t["scales"], t["zeros"]
        n = qweight.shape[0]
        k = int(qw.meta.get("in_features", qweight.shape[1] * 8))
        if qweight.shape[1] != -(-k // 8):
            raise CheckpointFormatError(f"qweight {tuple(qweight.shape)} does not pack in_features {k}")
        out = {
            "weight_packed": qweight.to(torch.int32).contiguous(),
            "weight_scale": scales.contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if not is_symmetric_int4(zeros):
            out["weight_zero_point"] = pack_int4_dim0(zeros)
        return out

    def decode(self, local, meta, where):
        packed = _need(local, "weight_packed", where)
        scales = _need(local, "weight_scale", where)
        if "weight_g_idx" in local:
            raise CheckpointFormatError(f"'{where}': activation-ordered int4 (weight_g_idx) is not supported")
        if packed.dtype != torch.int32 or packed.dim() != 2:
            raise CheckpointFormatError(f"'{where}.weight_packed' must be int32 2-D, got {packed.dtype} {tuple(packed.shape)}")
        n = packed.shape[0]
        k = packed.shape[1] * 8
        if "weight_shape" in local:
            shape = [int(x) for x in local["weight_shape"].tolist()]
            if len(shape) != 2 or shape[0] != n or not 0 < shape[1] <= k or -(-shape[1] // 8) != packed.shape[1]:
                raise CheckpointFormatError(
                    f"'{where}.weight_shape' {shape} does not match weight_packed {tuple(packed.shape)} "
                    f"(4-bit packing, 8 values per int32 along in_features)")
            k = shape[1]
        if scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1]:
            raise CheckpointFormatError(f"'{where}.weight_scale' shape {tuple(scales.shape)} does not fit weight [{n}, {k}]")
        group_size = k // scales.shape[1]
        if "weight_zero_point" in local:
            zp = local["weight_zero_point"]
            want = ((n + 7) // 8, scales.shape[1])
            if zp.dtype != torch.int32 or tuple(zp.shape) != want:
                raise CheckpointFormatError(
                    f"'{where}.weight_zero_point' must be int32 {list(want)} (packed along dim 0), "
                    f"got {zp.dtype} {list(zp.shape)}")
            zeros = unpack_int4_dim0(zp, n)
        else:
            zeros = torch.full(tuple(scales.shape), 8, dtype=torch.uint8)
        m = {"group_size": group_size, "in_features": k}
        if scales.shape[1] == 1 and "group_size" not in (meta or {}):
            m["strategy"] = "channel"   # a checkpoint without our manifest: one scale per row
        m.update(meta or {})
        return QuantizedWeight("w4a16", {"qweight": packed, "scales": scales, "zeros": zeros}, m)


def _int8_rows(local, scale_name: str, where: str, scheme: str):
    """An int8 2-D ``weight`` and its one-value-per-row scale tensor, checked."""
    w = _need(local, "weight", where)
    s = _need(local, scale_name, where)
    if w.dtype != torch.int8 or w.dim() != 2:
        raise CheckpointFormatError(f"'{where}.weight' must be int8 2-D for {scheme}, got {w.dtype} {tuple(w.shape)}")
    if s.numel() != w.shape[0]:
        raise CheckpointFormatError(f"'{where}.{scale_name}' has {s.numel()} values; "
                                    f"the weight has {w.shape[0]} rows (one scale per row)")
    return w, s


class W8A8Codec(SchemeCodec):
    def encode(self, qw):
        t = qw.tensors
        return {"weight": t["qweight"].to(torch.int8).contiguous(),
                "weight_scale": t["weight_scale"].reshape(-1, 1).contiguous()}

    def decode(self, local, meta, where):
        w, s = _int8_rows(local, "weight_scale", where, "w8a8")
        return QuantizedWeight("w8a8", {"qweight": w, "weight_scale": s.reshape(-1).to(torch.float32)},
                               dict(meta or {}))


class LLMInt8Codec(SchemeCodec):
    def encode(self, qw):
        t = qw.tensors
        scb = (t["weight_scale"].to(torch.float64) * 127.0).to(torch.float32)
        return {
            "weight": t["qweight"].to(torch.int8).contiguous(),
            "SCB": scb.contiguous(),
            "weight_format": torch.tensor(0, dtype=torch.uint8),
            "outlier_idx": t["outlier_idx"].to(torch.int64).contiguous(),
            "outlier_weight": t["outlier_weight"].contiguous(),
        }

    def decode(self, local, meta, where):
        w, scb = _int8_rows(local, "SCB", where, "llm_int8")
        if "weight_format" in local and int(local["weight_format"].reshape(-1)[0]) != 0:
            raise CheckpointFormatError(f"'{where}.weight_format' is not 0 (row-major); only 'row' is supported")
        if ("outlier_idx" in local) != ("outlier_weight" in local):
            missing = "outlier_weight" if "outlier_idx" in local else "outlier_idx"
            raise CheckpointFormatError(f"missing tensor '{where}.{missing}'")
        if "outlier_idx" in local:
            idx, ow = local["outlier_idx"].to(torch.int64), local["outlier_weight"]
        else:  # a plain bitsandbytes checkpoint: no outlier columns stored
            idx, ow = torch.zeros(0, dtype=torch.int64), torch.zeros(w.shape[0], 0, dtype=torch.float32)
        if ow.shape != (w.shape[0], idx.numel()):
            raise CheckpointFormatError(
                f"'{where}.outlier_weight' shape {tuple(ow.shape)} != [{w.shape[0]}, {idx.numel()}]")
        scale = (scb.to(torch.float64) / 127.0).to(torch.float32)
        return QuantizedWeight("llm_int8", {"qweight": w, "weight_scale": scale, "outlier_idx": idx,
                                            "outlier_weight": ow}, dict(meta or {}))


CODECS: dict[str, SchemeCodec] = {
    "w4a16": W4A16Codec("w4a16", ("weight_packed", "weight_scale"), ("weight_shape", "weight_zero_point", "weight_g_idx")),
    "w8a8": W8A8Codec("w8a8", ("weight", "weight_scale")),
    "llm_int8": LLMInt8Codec("llm_int8", ("weight", "SCB"), ("weight_format", "outlier_idx", "outlier_weight")),
}


def is_symmetric_int4(zeros: torch.Tensor) -> bool:
    return bool((zeros.to(torch.int32) == 8).all())


def encode_quantized(module: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Full-name on-disk tensors for one quantized linear at ``module``."""
    codec = CODECS.get(qw.scheme)
    if codec is None:
        raise CheckpointFormatError(f"'{module}': scheme {qw.scheme!r} has no on-disk format")
    return {f"{module}.{k}": v for k, v in codec.encode(qw).items()}


# ---------------------------------------------------------------- detection on load

def detect_scheme(local_names: set[str], weight_dtype: torch.dtype | None) -> str | None:
    """Which quantized scheme a module's tensor names (local, e.g. 'weight_scale') form."""
    if "weight_packed" in local_names:
        return "w4a16"
    if "SCB" in local_names:
        return "llm_int8"
    if "weight_scale" in local_names and "weight" in local_names and weight_dtype == torch.int8:
        return "w8a8"
    return None


_QUANT_LOCALS = {n for c in CODECS.values() for n in c.required + c.optional}


def group_tensor_names(names: dict[str, torch.dtype]) -> tuple[list[str], dict[str, tuple[str, dict[str, str]]]]:
    """Split full tensor names into dense ones and quantized modules.

    ``names`` maps each tensor name to its dtype. Returns ``(dense_names,
    {module: (scheme, {local: full_name})})``. Biases stay dense.
    """
    by_module: dict[str, dict[str, str]] = {}
    for full in names:
        mod, _, local = full.rpartition(".")
        if local in _QUANT_LOCALS:
            by_module.setdefault(mod, {})[local] = full
    quantized: dict[str, tuple[str, dict[str, str]]] = {}
    claimed: set[str] = set()
    for mod, locs in by_module.items():
        wname = locs.get("weight")
        scheme = detect_scheme(set(locs), names.get(wname) if wname else None)
        if scheme is None:
            continue
        codec = CODECS[scheme]
        keep = {k: v for k, v in locs.items() if k in codec.required + codec.optional}
        quantized[mod] = (scheme, keep)
        claimed.update(keep.values())
    dense = [n for n in names if n not in claimed]
    return dense, quantized


def decode_quantized(module: str, scheme: str, local: dict[str, torch.Tensor], meta: dict | None = None
                     ) -> QuantizedWeight:
    return CODECS[scheme].decode(local, meta or {}, module)


# ---------------------------------------------------------------- quantization_config

def _w4a16_group_key(qw: QuantizedWeight) -> tuple:
    """Per-channel layers share one group whatever their K (their group_size is K)."""
    if qw.meta.get("strategy") == "channel":
        group = "channel"
    else:
        group = int(qw.meta.get("group_size", 128))
    return ("w4a16", group, is_symmetric_int4(qw.tensors["zeros"]))


def _ct_scheme(key: tuple, targets: list[str]) -> dict:
    if key[0] == "w4a16":
        _, group, symmetric = key
        strategy, group_size = ("channel", None) if group == "channel" else ("group", group)
        return {
            "targets": targets,
            "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy,
                        "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None, "format": "pack-quantized",
        }
    return {
        "targets": targets,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "group_size": None, "dynamic": False, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "group_size": None, "dynamic": True, "observer": None},
        "output_activations": None, "format": "int-quantized",
    }


def _exact_target(module: str) -> str:
    return "re:^" + re.escape(module) + "$"


def build_quantization_config(quantized: dict[str, QuantizedWeight], dense_linears: list[str]) -> dict | None:
    """The ``quantization_config`` for config.json, or None for an unquantized model.

    * only w4a16 / w8a8 layers: compressed-tensors. One scheme -> one config group
      targeting ``Linear`` with every dense linear (and ``lm_head``) in ``ignore``,
      format ``pack-quantized`` / ``int-quantized``. Several (w4a16 + w8a8, or int4
      with different group sizes or symmetric + asymmetric): one group per scheme with
      exact ``re:^name$`` targets, each group carrying its own ``format``, top-level
      format ``mixed-precision`` (what llm-compressor writes for mixed models).
      ``dequantize: true`` is added when the single group is asymmetric int4 (see module
      doc); a mixed checkpoint with asymmetric int4 cannot be loaded by transformers 5.23.
    * only llm_int8 layers: bitsandbytes (``load_in_8bit``, ``llm_int8_threshold``,
      ``llm_int8_skip_modules`` = dense linears + lm_head).
    * llm_int8 mixed with other schemes: no ecosystem config describes that, so we
      write ``{"quant_method": "compress", "format": "compress-checkpoint", ...}``;
      transformers does not know it and will not load the model; our loader reads the
      manifest / tensor names.
    """
    if not quantized:
        return None
    schemes = {q.scheme for q in quantized.values()}
    ignore = sorted(set(dense_linears) | ({"lm_head"} - set(quantized)))  # unless lm_head is quantized
    if schemes == {"llm_int8"}:
        thresholds = {float(q.meta.get("threshold", 6.0)) for q in quantized.values()}
        return {
            "quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
            "llm_int8_threshold": max(thresholds), "llm_int8_skip_modules": ignore,
            "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False,
        }
    if "llm_int8" in schemes:
        return {"quant_method": "compress", "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                "schemes": sorted(schemes),
                "note": "mixed llm_int8 + other schemes: load with compress.io.load_checkpoint"}
    groups: dict[tuple, list[str]] = {}
    for name in sorted(quantized):
        q = quantized[name]
        key = _w4a16_group_key(q) if q.scheme == "w4a16" else ("w8a8",)
        groups.setdefault(key, []).append(name)
    single = len(groups) == 1
    config_groups = {}
    for i, (key, mods) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        targets = ["Linear"] if single else [_exact_target(m) for m in mods]
        config_groups[f"group_{i}"] = _ct_scheme(key, targets)
    if single:
        fmt = next(iter(config_groups.values()))["format"]
    else:
        fmt = "mixed-precision"
    qc = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": config_groups, "ignore": ignore, "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
    if single and any(k[0] == "w4a16" and not k[2] for k in groups):
        # Only with a single group: transformers' dequantize route decompresses every dense
        # module with the *first* config group's scheme (get_dense_scheme), so for a mixed
        # checkpoint it would be wrong. Mixed + asymmetric int4 therefore does not load in
        # transformers 5.23 (it stops on the zero-point shape mismatch); our loader reads it.
        qc["dequantize"] = True
    return qc
