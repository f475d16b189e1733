"""What a checkpoint holds, read from safetensors headers (no tensor data is loaded).

Bits per weight
---------------
``bits_per_weight`` (of the linears) = 8 * (bytes of all linear-layer weight data,
including scales, zero points, shapes, outlier columns and SCB) / (number of linear
weights, i.e. the sum of ``out_features * in_features``). "Linear layers" are every
quantized linear plus every dense 2-D ``*.weight`` inside the decoder blocks
(``model.layers.*``); embeddings, lm_head (unless quantized), norms and biases are not
linears. ``bits_per_weight_overall`` = 8 * (bytes of every tensor in the weight files)
/ ``parameter_count``, where ``parameter_count`` counts a quantized linear as its
``N * K`` logical weights and every other tensor by its element count. A dense fp16
model gives 16.0 for both; group-128 int4 with fp16 scales gives 4.125 (sym) or
4.156 (asym, 4-bit zero points) for the linears.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from compress.io.checkpoint import (find_weight_files, read_config_json, read_manifest,
                                    read_safetensors_header, resolve_model_path, verify_files)
from compress.io.formats import group_tensor_names

_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
           "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
           "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
           "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(dtype: str, shape) -> int:
    return _numel(shape) * _DTYPES.get(dtype, (None, 4))[1]


def inspect_checkpoint(path: str | os.PathLike, verify: bool = True) -> dict:
    """A JSON-serializable description of the checkpoint at ``path`` (see module doc)."""
    path = resolve_model_path(path)
    config = read_config_json(path)
    manifest = read_manifest(path)
    weight_files, _ = find_weight_files(path)
    header: dict[str, tuple[str, list[int]]] = {}
    for f in weight_files:
        header.update(read_safetensors_header(f))

    dense_names, groups = group_tensor_names({k: _DTYPES.get(d, (None,))[0] for k, (d, _) in header.items()})
    mlayers = (manifest or {}).get("layers", {})
    layers = {}
    lin_bytes = lin_weights = 0
    params = 0
    for mod in sorted(groups):
        scheme, locs = groups[mod]
        shapes = {k: header[v][1] for k, v in locs.items()}
        nbytes = sum(_nbytes(header[v][0], header[v][1]) for v in locs.values())
        if scheme == "w4a16":
            # K from the manifest when it says (a per-channel row's packed words round K up to 8)
            n = shapes["weight_packed"][0]
            k = int(mlayers.get(mod, {}).get("meta", {}).get("in_features") or shapes["weight_packed"][1] * 8)
            meta = {"group_size": k // max(1, shapes["weight_scale"][-1]),
                    "symmetric": "weight_zero_point" not in locs}
        else:
            n, k = shapes["weight"]
            meta = {}
            if scheme == "llm_int8":
                meta["outlier_columns"] = shapes["outlier_idx"][0] if "outlier_idx" in shapes else 0
        meta.update(mlayers.get(mod, {}).get("meta", {}))
        layers[mod] = {"scheme": scheme, "shape": [n, k], "bytes": nbytes,
                       "bits_per_weight": round(8 * nbytes / (n * k), 4), "meta": meta}
        lin_bytes += nbytes
        lin_weights += n * k
        params += n * k
    dense_bytes = 0
    for name in sorted(dense_names):
        dtype, shape = header[name]
        nb = _nbytes(dtype, shape)
        dense_bytes += nb
        params += _numel(shape)
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        if mod and len(shape) == 2 and ".layers." in f".{mod}." and dtype.startswith(("F", "BF")):
            layers[mod] = {"scheme": "dense", "shape": list(shape), "bytes": nb,
                           "bits_per_weight": round(8 * nb / _numel(shape), 4), "meta": {"dtype": dtype}}
            lin_bytes += nb
            lin_weights += _numel(shape)
    layers = dict(sorted(layers.items()))
    total_tensor_bytes = sum(_nbytes(dt, shape) for dt, shape in header.values())

    files = verify_files(path, manifest, strict=False) if verify else {
        f.relative_to(path).as_posix(): {"size": f.stat().st_size, "status": "unverified"}
        for f in sorted(path.rglob("*")) if f.is_file()}
    scheme_counts: dict[str, int] = {}
    for info in layers.values():
        scheme_counts[info["scheme"]] = scheme_counts.get(info["scheme"], 0) + 1
    qc = config.get("quantization_config") or {}
    return {
        "path": str(path),
        "format": manifest["format"] if manifest else ("huggingface" if not qc else f"huggingface+{qc.get('quant_method')}"),
        "format_version": manifest["format_version"] if manifest else None,
        "tool_version": manifest.get("tool_version") if manifest else None,
        "architecture": (config.get("architectures") or [None])[0],
        "model_type": config.get("model_type"),
        "quant_method": qc.get("quant_method"),
        "quant_format": qc.get("format"),
        "layers": layers,
        "scheme_counts": scheme_counts,
        "parameter_count": params,
        "linear_weight_count": lin_weights,
        "weights_bytes": sum(f.stat().st_size for f in weight_files),
        "tensor_bytes": total_tensor_bytes,
        "size_on_disk_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
        "bits_per_weight": round(8 * lin_bytes / lin_weights, 4) if lin_weights else None,
        "bits_per_weight_overall": round(8 * total_tensor_bytes / params, 4) if params else None,
        "files": files,
        "verified": (all(f["status"] == "ok" for f in files.values() if f["status"] != "unlisted")
                     if manifest and verify else None),
        "extra": (manifest or {}).get("extra", {}),
    }


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def format_inspect(d: dict) -> str:
    """Human-readable text of :func:`inspect_checkpoint`'s result (for ``compress inspect``)."""
    fv = f" v{d['format_version']}" if d.get("format_version") is not None else ""
    lines = [
        f"checkpoint   {d['path']}",
        f"format       {d['format']}{fv}" + (f" (written by compress {d['tool_version']})" if d.get("tool_version") else ""),
        f"architecture {d['architecture']} (model_type {d['model_type']})",
        f"quantization {d['quant_method'] or 'none'}" + (f" / {d['quant_format']}" if d.get("quant_format") else ""),
        f"parameters   {d['parameter_count']:,} ({d['linear_weight_count']:,} in linear layers)",
        f"size         {_human(d['weights_bytes'])} weights, {_human(d['size_on_disk_bytes'])} on disk",
        f"bits/weight  {d['bits_per_weight']} (linears), {d['bits_per_weight_overall']} (whole model)",
        "schemes      " + ", ".join(f"{k}: {v}" for k, v in sorted(d["scheme_counts"].items())),
        "",
        "layers:",
    ]
    width = max((len(n) for n in d["layers"]), default=10)
    for name, info in d["layers"].items():
        meta = ", ".join(f"{k}={v}" for k, v in sorted(info["meta"].items()))
        lines.append(f"  {name:<{width}}  {info['scheme']:<8} {str(info['shape']):<12} "
                     f"{info['bits_per_weight']:>7.3f} b/w  {meta}")
    lines += ["", "files:"]
    for name, info in d["files"].items():
        sha = (info.get("sha256") or "")[:16]
        size = "-" if info.get("size") is None else _human(info["size"])
        lines.append(f"  {name:<40} {size:>10}  {sha:<16}  {info['status']}")
    if d.get("verified") is not None:
        lines.append("")
        lines.append("checksums    " + ("all OK" if d["verified"] else "MISMATCH (see files above)"))
    return "\n".join(lines)
