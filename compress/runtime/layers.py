"""Quantized linear layers the runtime executes, one class per weight scheme.

Every layer holds its weights in the canonical op layout (see
``compress/ops/reference.py``) and calls the ``torch.ops.compress`` op for it, so the
same layer runs on the reference, the C++ CPU kernels or the CUDA kernels. A kernel
that wants another layout repacks in ``prepare()`` (called once at load time), never
on disk.
"""
from __future__ import annotations

import torch
from torch import nn

from compress.ops import cpu_isa, get_op, native_available, w4a16_amx_available, w8a8_amx_available
from compress.runtime.int4_padding import pad_activations, pad_int4_in_features
from compress.runtime.outlier_columns import checked_outlier_idx
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS
from compress.ops.reference import (w4a8_lanes_supported, w4a8_prepare_lanes, w4a8_unprepare_lanes,
                                    w4a16_lanes_supported, w4a16_prepare_cpu_scales, w4a16_tile_cpu,
                                    w4a16_untile_cpu, w8a8_outlier_gemm_guarded, w8a8_prepare_lanes, w8a8_tile_cpu,
                                    w8a8_unprepare_lanes, w8a8_untile_cpu, W8_LANES_MAX_K)

# Whether int4 layers take the weight-row-lane layout (csrc/cpu/w4a8_lanes.cpp,
# w4a16_lanes.cpp: vector lanes = weight rows), read at prepare(); False for timings of the
# row-tiled kernels. Its ops give a row the same bits whatever its batch mates, threads or
# ISA level (the row-tiled ones differ by float rounding), so int4 layers take it on AVX2
# and AVX-512 CPUs, except int8 activations on CPUs with usable AMX-BF16 (they keep the
# row-tiled layout that their bf16 tiles read from 16 rows). On such a CPU (2-vCPU Xeon,
# 345M bench model, int8 activations) the lanes layout, with its AMX-INT8 tiles from 64
# rows, decoded batch 1 at 0.8x and batch 16 at 1.17-1.22x against the int8 tiles that
# then ran 16 rows (the bf16 tiles since: 1.19x those; lanes against them not
# re-measured; csrc/cpu/README.md).
INT4_LANES = True
# Whether W8A8 layers take the weight-row-lane layout (csrc/cpu/w8a8_lanes.cpp) where
# int8_lanes_wanted(); the same bits as the row-tiled kernels.
INT8_LANES = True


def int4_lanes_wanted(activations: str = DEFAULT_W4_ACTIVATIONS) -> bool:
    """Whether this CPU runs int4 layers with these activations on the lanes layout: not
    int8 activations where the AMX tiles run them (AVX-512 active, AMX-BF16 present), which
    read the row-tiled layout."""
    isa = cpu_isa()
    if not (INT4_LANES and native_available("cpu")) or isa not in ("avx512_vnni", "avx2"):
        return False
    return activations != "int8" or isa != "avx512_vnni" or not w4a16_amx_available()


def int8_lanes_wanted(k: int) -> bool:
    """Whether this CPU runs a W8A8 layer of K inputs on the lanes layout: AVX-512 VNNI
    without AMX-INT8 (whose tiles read the row-tiled layout), K within the layout's int32
    sums."""
    return (INT8_LANES and native_available("cpu") and cpu_isa() == "avx512_vnni" and not w8a8_amx_available()
            and k <= W8_LANES_MAX_K)


class DenseLinear(nn.Module):
    scheme = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def prepare(self, backend: str = "native") -> None:
        pass

    def decode_spec(self):
        """``(scheme, group_size, tensors, bias)`` for ``compress::decode_layer``."""
        return "dense", 0, [self.weight], self.bias

    def relocate(self, place) -> None:
        """Passes the tensors a GEMM streams through ``place`` and keeps what it returns
        (``hugepages.relocate_to_huge_pages``)."""
        self.weight = nn.Parameter(place(self.weight.data), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype),
                                    None if self.bias is None else self.bias.to(x.dtype))


class _OpLinear(nn.Module):
    """Base: flattens leading dims, calls ``self.gemm`` on [M, K], adds the bias."""

    op_name: str = ""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.backend = "native"

    def prepare(self, backend: str = "native") -> None:
        self.backend = backend

    def gemm(self, x2d: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    streamed = ()  # names of the tensors a GEMM call streams (the weights and their scales)

    def relocate(self, place) -> None:
        """Passes the tensors a GEMM streams through ``place`` and keeps what it returns
        (``hugepages.relocate_to_huge_pages``)."""
        for name in self.streamed:
            setattr(self, name, place(getattr(self, name)))

    def decode_spec(self):
        """``(scheme, group_size, tensors, bias)`` naming this layer's weights the way
        ``compress::decode_layer`` takes them (``reference.DECODE_LAYER_TENSORS``), or
        ``None`` when the fused decode op has no form for it."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.gemm(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class _CpuTiledWeight:
    """Mixin: the CPU kernels' load-time row tiling of ``qweight`` (reference.w4a16_tile_cpu
    / w8a8_tile_cpu), which replaces the canonical tensor (no second copy) while the layer
    is prepared for the native CPU backend; preparing for another backend restores it."""

    qweight_tiled = False
    _tile = _untile = None  # the scheme's reference tiling functions (staticmethods)

    def _retile(self, backend: str) -> bool:
        """Restore the canonical qweight, then tile it if the native CPU kernels will run
        this layer; returns whether it is tiled now."""
        if self.qweight_tiled:
            self.qweight, self.qweight_tiled = self._untile(self.qweight), False
        self.qweight = self.qweight.contiguous()
        if backend == "native" and self.qweight.device.type == "cpu" and native_available("cpu"):
            self.qweight, self.qweight_tiled = self._tile(self.qweight), True
        return self.qweight_tiled

    def canonical_qweight(self) -> torch.Tensor:
        return self._untile(self.qweight) if self.qweight_tiled else self.qweight


class Int4Linear(_CpuTiledWeight, _OpLinear):
    """W4A16: groupwise asymmetric int4 weights, float activations. A per-channel weight
    whose K the kernels cannot take is padded here, once (``runtime/int4_padding.py``).
    ``activations`` (set before ``prepare``): "float" (the default) or "int8", the CPU
    fast path (``compress/w4_activations.py``)."""
    scheme = "w4a16"
    op_name = "w4a16_gemm"
    activations = DEFAULT_W4_ACTIVATIONS
    _tile, _untile = staticmethod(w4a16_tile_cpu), staticmethod(w4a16_untile_cpu)

    lanes_scales = None  # (scale, zeros) [tiles, K/G, 16] while qweight is in the lanes layout (w4a8_prepare_lanes)

    def __init__(self, qweight, scales, zeros, group_size: int, in_features: int, bias=None):
        super().__init__(qweight.shape[0], in_features, bias)
        qweight, group_size = pad_int4_in_features(qweight, zeros, group_size, in_features)
        self.k_padded = qweight.shape[1] * 8  # the K the kernels see (in_features unless padded)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.group_size = group_size
        self.cuda_layout = None
        self.cuda_scales = None  # the CUDA layout's scales in the activation dtype (_cuda_scales)
        self.cpu_scales = None

    def prepare(self, backend: str = "native") -> None:
        # The CPU kernels want qweight row-tiled (_CpuTiledWeight) and fp32 scales with
        # uint8 zeros, made once here rather than per call; where int4_lanes_wanted, the
        # lanes layout instead.
        if self.lanes_scales is not None:
            self.qweight, self.lanes_scales = w4a8_unprepare_lanes(self.qweight, self.out_features), None
        super().prepare(backend)
        self.scales = self.scales.contiguous()
        self.zeros = self.zeros.to(torch.uint8).contiguous()
        self.cpu_scales = None
        self.cuda_layout = self.cuda_scales = None
        # the float op's shapes include every one the int8 op takes
        if (backend == "native" and self.qweight.device.type == "cpu"
                and w4a16_lanes_supported(self.k_padded, self.group_size) and int4_lanes_wanted(self.activations)):
            if self.qweight_tiled:
                self.qweight, self.qweight_tiled = self._untile(self.qweight), False
            self.qweight, *scales = w4a8_prepare_lanes(self.qweight.contiguous(), self.scales, self.zeros)
            self.lanes_scales = tuple(scales)
            self.lanes_n = torch.tensor([self.out_features], dtype=torch.int64)
            return
        if self._retile(backend):
            self.cpu_scales = w4a16_prepare_cpu_scales(self.scales, self.zeros)
        # On CUDA the tensor-core kernel wants the weights in mma fragment order: shuffle
        # once at load time (kept beside the canonical tensors, never saved).
        if (backend == "native" and self.qweight.is_cuda and native_available("cuda")
                and self.group_size % 16 == 0):
            self.cuda_layout = torch.ops.compress.w4a16_shuffle_for_cuda(
                self.qweight, self.scales, self.zeros, self.group_size)

    def _int8_lanes(self) -> bool:
        """Whether the lanes layer runs the int8-activation op: int8 on its group sizes (32,
        multiples of 64); other sizes run the float math, as the reference does."""
        return self.activations == "int8" and w4a8_lanes_supported(self.k_padded, self.group_size)

    def canonical_qweight(self) -> torch.Tensor:
        if self.lanes_scales is not None:
            return w4a8_unprepare_lanes(self.qweight, self.out_features)
        return super().canonical_qweight()

    def relocate(self, place) -> None:
        self.qweight = place(self.qweight)
        if self.lanes_scales is not None:
            self.lanes_scales = tuple(place(t) for t in self.lanes_scales)
            return
        if self.cpu_scales is None:
            self.scales, self.zeros = place(self.scales), place(self.zeros)
            return
        scale, zeros = self.cpu_scales
        self.cpu_scales = (place(scale), place(zeros))
        # w4a16_prepare_cpu_scales hands back the checkpoint's own tensors where their
        # dtypes already fit: keep one copy
        if scale is self.scales:
            self.scales = self.cpu_scales[0]
        if zeros is self.zeros:
            self.zeros = self.cpu_scales[1]

    def read_bytes(self) -> int:
        """Bytes one call reads for its weights (the packed ints plus the scales the
        kernel on this device uses)."""
        if self.lanes_scales is not None:
            scales = sum(t.numel() * t.element_size() for t in self.lanes_scales)
        elif self.cpu_scales is not None:
            scales = sum(t.numel() * t.element_size() for t in self.cpu_scales)
        elif self.cuda_layout is not None:
            scales = sum(t.numel() * t.element_size() for t in self.cuda_layout[1:])
        else:
            scales = self.scales.numel() * self.scales.element_size() + self.zeros.numel()
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.qweight.numel() * 4 + scales + bias

    def _cuda_scales(self, dtype: torch.dtype) -> torch.Tensor:
        """The CUDA layout's scales in the activation dtype (the kernel multiplies in it):
        converted on the first call with that dtype, not on every call."""
        scales_t = self.cuda_layout[1]
        if scales_t.dtype == dtype:
            return scales_t
        if self.cuda_scales is None or self.cuda_scales.dtype != dtype:
            self.cuda_scales = scales_t.to(dtype)
        return self.cuda_scales

    def decode_spec(self):
        if self.k_padded != self.in_features:  # decode_layer passes x unpadded
            return None
        if self.lanes_scales is not None:
            scheme = "w4a8_lanes" if self._int8_lanes() else "w4a16_lanes"
            return scheme, self.group_size, [self.qweight, *self.lanes_scales, self.lanes_n], self.bias
        if self.cpu_scales is None:
            return None
        scheme = "w4a8_prepared" if self.activations == "int8" else "w4a16_prepared"
        return scheme, self.group_size, [self.qweight, *self.cpu_scales], self.bias

    def gemm(self, x2d):
        x2d = pad_activations(x2d, self.k_padded)
        int8 = self.activations == "int8"
        if self.lanes_scales is not None:
            op = torch.ops.compress.w4a8_gemm_lanes if self._int8_lanes() else torch.ops.compress.w4a16_gemm_lanes
            return op(x2d, self.qweight, *self.lanes_scales, self.group_size, self.out_features)
        if self.cuda_layout is not None and not int8 and x2d.dtype in (torch.float16, torch.bfloat16):
            qs, _, zt = self.cuda_layout
            return torch.ops.compress.w4a16_gemm_shuffled(x2d, qs, self._cuda_scales(x2d.dtype), zt,
                                                          self.group_size, self.out_features)
        if self.cpu_scales is not None:
            op = torch.ops.compress.w4a8_gemm_prepared if int8 else torch.ops.compress.w4a16_gemm_prepared
            return op(x2d, self.qweight, *self.cpu_scales, self.group_size)
        op = get_op("w4a8_gemm" if int8 else self.op_name, self.backend)
        return op(x2d, self.qweight, self.scales, self.zeros, self.group_size)


class Int8Linear(_CpuTiledWeight, _OpLinear):
    """W8A8: per-channel int8 weights, per-token dynamic int8 activations."""
    scheme = "w8a8"
    op_name = "w8a8_gemm"
    _tile, _untile = staticmethod(w8a8_tile_cpu), staticmethod(w8a8_untile_cpu)
    streamed = ("qweight", "weight_scale")

    lanes = None  # (scale, rowsum, n) while qweight is in the lanes layout (w8a8_prepare_lanes)

    def __init__(self, qweight, weight_scale, bias=None):
        super().__init__(qweight.shape[0], qweight.shape[1], bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale)

    def prepare(self, backend: str = "native") -> None:
        # from the canonical tensor whichever layout an earlier prepare left (lanes or tiled)
        self.qweight = self.canonical_qweight()
        self.lanes, self.qweight_tiled = None, False
        super().prepare(backend)
        self.weight_scale = self.weight_scale.contiguous()
        if backend == "native" and self.qweight.device.type == "cpu" and int8_lanes_wanted(self.in_features):
            q, scale, rowsum = w8a8_prepare_lanes(self.qweight.contiguous(), self.weight_scale)
            self.qweight = q
            self.lanes = (scale, rowsum, torch.tensor([self.out_features], dtype=torch.int64))
            return
        self._retile(backend)

    def canonical_qweight(self) -> torch.Tensor:
        if self.lanes is not None:
            return w8a8_unprepare_lanes(self.qweight, self.out_features, self.in_features)
        return super().canonical_qweight()

    def relocate(self, place) -> None:
        if self.lanes is None:
            return super().relocate(place)
        self.qweight = place(self.qweight)
        self.lanes = (place(self.lanes[0]), place(self.lanes[1]), self.lanes[2])

    def read_bytes(self) -> int:
        """Bytes one call reads for its weights (the int8 weights and their scales, in the
        layout the kernel on this device uses)."""
        meta = self.lanes[:2] if self.lanes is not None else (self.weight_scale,)
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.qweight.numel() + sum(t.numel() * t.element_size() for t in meta) + bias

    def decode_spec(self):
        if self.lanes is not None:
            return "w8a8_lanes", 0, [self.qweight, *self.lanes], self.bias
        if not self.qweight_tiled:
            return None
        return "w8a8_prepared", 0, [self.qweight, self.weight_scale], self.bias

    def gemm(self, x2d):
        if self.lanes is not None:
            return torch.ops.compress.w8a8_gemm_lanes(x2d, self.qweight, *self.lanes[:2], self.out_features)
        if self.qweight_tiled:
            return torch.ops.compress.w8a8_gemm_prepared(x2d, self.qweight, self.weight_scale)
        return get_op(self.op_name, self.backend)(x2d, self.qweight, self.weight_scale)


class Int8OutlierLinear(_CpuTiledWeight, _OpLinear):
    """LLM.int8(): W8A8 plus outlier input columns kept in float (fused op)."""
    scheme = "llm_int8"
    op_name = "w8a8_outlier_gemm"
    _tile, _untile = staticmethod(w8a8_tile_cpu), staticmethod(w8a8_untile_cpu)
    streamed = ("qweight", "weight_scale", "outlier_weight")

    def __init__(self, qweight, weight_scale, outlier_idx, outlier_weight, bias=None,
                 threshold: float | None = None):
        super().__init__(qweight.shape[0], qweight.shape[1], bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("outlier_idx", outlier_idx)
        self.register_buffer("outlier_weight", outlier_weight)
        self.threshold = threshold  # spike guard (reference.w8a8_outlier_gemm_guarded); None: static set only
        self.threshold_tensor = None  # the threshold as decode_layer takes it (made in prepare)

    def prepare(self, backend: str = "native") -> None:
        super().prepare(backend)
        self._retile(backend)  # the native prepared op runs the spike guard itself
        self.weight_scale = self.weight_scale.contiguous()
        self.outlier_idx = checked_outlier_idx(self.outlier_idx, self.out_features, self.in_features)
        self.outlier_weight = self.outlier_weight.contiguous()
        if self.outlier_weight.is_cuda:  # the CUDA epilogue sums the outliers in fp32: convert once here
            self.outlier_weight = self.outlier_weight.float()
        self.threshold_tensor = (None if self.threshold is None
                                 else torch.tensor(float(self.threshold), dtype=torch.float32))

    def decode_spec(self):
        if not self.qweight_tiled:
            return None
        tensors = [self.qweight, self.weight_scale, self.outlier_idx, self.outlier_weight]
        if self.threshold is None:
            return "llm_int8_prepared", 0, tensors, self.bias
        return "llm_int8_guarded_prepared", 0, [*tensors, self.threshold_tensor], self.bias

    def gemm(self, x2d):
        if self.qweight_tiled:
            return torch.ops.compress.w8a8_outlier_gemm_prepared(
                x2d, self.qweight, self.weight_scale, self.outlier_idx, self.outlier_weight,
                None if self.threshold is None else float(self.threshold))
        op = get_op(self.op_name, self.backend)
        if self.threshold is None:
            return op(x2d, self.qweight, self.weight_scale, self.outlier_idx, self.outlier_weight)
        return w8a8_outlier_gemm_guarded(x2d, self.qweight, self.weight_scale, self.outlier_idx,
                                         self.outlier_weight, self.threshold, gemm=op)


def _cat_bias(layers) -> torch.Tensor | None:
    if all(layer.bias is None for layer in layers):
        return None
    ref = next(layer.bias for layer in layers if layer.bias is not None)
    return torch.cat([layer.bias.data if layer.bias is not None else ref.new_zeros(layer.out_features)
                      for layer in layers])


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``cat([layer(x) for layer in layers], -1)``, or ``None`` when
    the layers cannot share a kernel call (different schemes, input sizes, group sizes or
    outlier columns). Linears that read the same input (q/k/v, gate/up) are fused at load
    time so a decode step makes one kernel call (and one activation quantization) instead
    of three; every output row is computed exactly as before. Call before ``prepare``."""
    first = layers[0]
    if len(layers) < 2 or any(type(layer) is not type(first) or layer.in_features != first.in_features
                              for layer in layers):
        return None
    bias = _cat_bias(layers)
    cat = lambda name: torch.cat([getattr(layer, name) for layer in layers])  # noqa: E731
    if isinstance(first, DenseLinear):
        if len({layer.weight.dtype for layer in layers}) > 1:
            return None
        return DenseLinear(cat("weight"), bias)
    if isinstance(first, Int4Linear):
        if len({layer.group_size for layer in layers}) > 1 or len({layer.scales.dtype for layer in layers}) > 1:
            return None
        qweight = torch.cat([layer.canonical_qweight() for layer in layers])
        zeros = torch.cat([layer.zeros.to(torch.uint8) for layer in layers])
        return Int4Linear(qweight, cat("scales"), zeros, first.group_size, first.in_features, bias)
    if isinstance(first, Int8OutlierLinear):
        same_cols = all(torch.equal(layer.outlier_idx.to(torch.long), first.outlier_idx.to(torch.long))
                        for layer in layers)
        if not same_cols or len({layer.threshold for layer in layers}) > 1 \
                or len({layer.outlier_weight.dtype for layer in layers}) > 1:
            return None
        qweight = torch.cat([layer.canonical_qweight() for layer in layers])
        return Int8OutlierLinear(qweight, cat("weight_scale"), first.outlier_idx, cat("outlier_weight"),
                                 bias, first.threshold)
    if isinstance(first, Int8Linear):
        return Int8Linear(torch.cat([layer.canonical_qweight() for layer in layers]), cat("weight_scale"), bias)
    return None


LAYER_CLASSES = {cls.scheme: cls for cls in (DenseLinear, Int4Linear, Int8Linear, Int8OutlierLinear)}
LINEAR_TYPES = (DenseLinear, _OpLinear)
