"""Pure-PyTorch reference implementations of every compress op.

These are the definitions of what each op computes. Native kernels (C++ CPU in
``csrc/cpu``, CUDA in ``csrc/cuda``) must match them; tests compare against them.

Canonical layouts (the same as the on-disk compressed-tensors layouts, so a
checkpoint needs no conversion to be run by the reference):

* int4 weights ``qweight``: int32 ``[N, K // 8]``; column ``k`` of row ``n`` is the
  nibble at bits ``4 * (k % 8)`` of word ``k // 8``, stored unsigned (``u = q + 8``,
  ``u`` in 0..15).
* int4 zero points ``zeros``: uint8 ``[N, K // group_size]`` in the unsigned domain
  (0..15), so ``w = (u - z) * scale``.
* int8 weights: int8 ``[N, K]``, symmetric, ``w = q * weight_scale[n]``.
"""
from __future__ import annotations

import math

import sys

import torch

from compress.ops import kv_int8

INT8_MAX = 127.0


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 ``[N, K/8]`` -> uint8 ``[N, K]`` of unsigned nibbles (0..15)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(qweight.shape[0], -1).to(torch.uint8)


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` of unsigned nibbles (0..15) -> int32 ``[N, K/8]``: nibble ``j`` of
    a word is column ``8w + j``, bits ``4j..4j+3``."""
    n, k = nibbles.shape
    if k % 8:
        raise ValueError(f"int4 packing needs K divisible by 8, got K={k}")
    if sys.byteorder == "little":
        # two nibbles per byte, four bytes per word: the bytes of a little-endian int32
        pairs = nibbles.to(torch.uint8).reshape(n, k // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)
    vals = nibbles.to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=nibbles.device, dtype=torch.int64)
    words = (vals << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)   # the low 32 bits as signed int32
    return words.to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Groupwise asymmetric int4 -> dense ``[N, K]`` weight."""
    u = unpack_int4(qweight).to(torch.float32)
    n, k = u.shape
    g = u.reshape(n, k // group_size, group_size)
    w = (g - zeros.to(torch.float32).unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x [M, K] @ dequant(W) [N, K]^T -> [M, N]`` in x's dtype, fp32 accumulation."""
    w = dequantize_int4(qweight, scales, zeros, group_size, torch.float32)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


# The CPU kernels' load-time row tiling (int4 and int8 alike): each group of
# CPU_TILE_ROWS rows is stored with its chunks (of `chunk` elements of the stored tensor)
# interleaved, so the rows an M = 1 tile reads are one sequential stream. Rows past the
# last full tile, and all rows when a row is not a whole number of chunks, stay row-major.
CPU_TILE_ROWS = 4
W4_CPU_TILE_CHUNK = 8    # int32 words = 64 k of packed int4
W8_CPU_TILE_CHUNK = 64   # int8 k


def _tiled_rows(t: torch.Tensor, chunk: int) -> int:
    n, k = t.shape
    return n - n % CPU_TILE_ROWS if k % chunk == 0 else 0


def _cpu_tile(t: torch.Tensor, chunk: int, untile: bool = False) -> torch.Tensor:
    n4 = _tiled_rows(t, chunk)
    if n4 == 0:
        return t.contiguous()
    k = t.shape[1]
    dims = (n4 // CPU_TILE_ROWS, CPU_TILE_ROWS, k // chunk, chunk)
    if untile:
        dims = (dims[0], dims[2], dims[1], dims[3])
    head = t[:n4].reshape(dims).permute(0, 2, 1, 3).reshape(n4, k)
    return torch.cat([head, t[n4:]]).contiguous()


def w4a16_tile_cpu(qweight: torch.Tensor) -> torch.Tensor:
    """Load-time weight layout of the CPU int4 kernel: the canonical int32 ``[N, K/8]``
    with each group of 4 rows chunk-interleaved (chunk = 8 words = 64 k): row r's chunk c
    of a tile sits at words ``32 c + 8 r`` of that tile's ``4 * K/8`` words. Rows past the
    last full tile (and all rows when K % 64 != 0) stay row-major. Same shape and dtype."""
    return _cpu_tile(qweight, W4_CPU_TILE_CHUNK)


def w4a16_untile_cpu(qweight_tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`w4a16_tile_cpu`: back to the canonical ``[N, K/8]``."""
    return _cpu_tile(qweight_tiled, W4_CPU_TILE_CHUNK, untile=True)


def w4a16_prepare_cpu_scales(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's group metadata: fp32 scales and uint8 zero points, both
    ``[N, K // group_size]`` (5 bytes per group; the checkpoint's own tensors when they
    already have those dtypes), so ``w = u * scale - scale * zero``."""
    return scales.to(torch.float32).contiguous(), zeros.to(torch.uint8).contiguous()


def w4a16_prepare_cpu(qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load-time form of an int4 linear for the CPU kernel (``w4a16_gemm_prepared``): the
    row-tiled qweight (:func:`w4a16_tile_cpu`) and :func:`w4a16_prepare_cpu_scales`."""
    return (w4a16_tile_cpu(qweight), *w4a16_prepare_cpu_scales(scales, zeros))


def w4a16_gemm_prepared(x: torch.Tensor, qweight_tiled: torch.Tensor, scale: torch.Tensor,
                        zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """:func:`w4a16_gemm` on :func:`w4a16_prepare_cpu`'s tensors: the same weights
    ``w = (u - zero) * scale`` in fp32 and float activations."""
    return w4a16_gemm(x, w4a16_untile_cpu(qweight_tiled), scale, zeros, group_size)


# --- int4 weights x int8 activations: the CPU fast path of a w4a16 checkpoint ------------
# As llama.cpp multiplies Q4 weights by Q8 activations: each row of x is quantized to int8
# per block of 32 along K (symmetric, scale = absmax / 127, round half to even), the dot
# products run in integers and each block's sum is scaled back. Faster on CPUs than float
# activations, but not the numbers the w4a16 scheme promises (~0.4% off in a model's
# logits); the runtime takes it only when asked (LLM(w4_activations="int8")).
W4A8_BLOCK = 32


def w4a8_group_supported(group_size: int) -> bool:
    """Whether the int8-activation kernel takes this group size (32, or a multiple of 64);
    :func:`w4a8_gemm` runs other sizes with float activations, as :func:`w4a16_gemm`."""
    return group_size == W4A8_BLOCK or group_size % 64 == 0


def quantize_blocks_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K % 32 == 0) -> int8 ``q [M, K]`` and fp32 ``scale [M, K / 32]`` with
    ``x ≈ q * scale`` per block of 32: ``q = round_half_even(x * (127 / absmax))``, scale
    ``absmax / 127`` (an all-zero block: q = 0, scale 0)."""
    m, k = x.shape
    if k % W4A8_BLOCK:
        raise ValueError(f"quantize_blocks_int8 needs K divisible by {W4A8_BLOCK}, got K={k}")
    xb = x.to(torch.float32).reshape(m, k // W4A8_BLOCK, W4A8_BLOCK)
    amax = xb.abs().amax(dim=-1)
    # 127 / amax as one IEEE division, as the kernel (a Python scalar over a tensor is a
    # reciprocal and a multiply in torch, which can round the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, INT8_MAX) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(m, k), amax / INT8_MAX


def w4a8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """:func:`w4a16_gemm` with ``x`` quantized per block of 32 first
    (:func:`quantize_blocks_int8`), when :func:`w4a8_group_supported`."""
    if not w4a8_group_supported(group_size):
        return w4a16_gemm(x, qweight, scales, zeros, group_size)
    q, scale = quantize_blocks_int8(x)
    m, k = q.shape
    xq = (q.to(torch.float32).reshape(m, -1, W4A8_BLOCK) * scale.unsqueeze(-1)).reshape(m, k)
    return w4a16_gemm(xq, qweight, scales, zeros, group_size).to(x.dtype)


def w4a8_gemm_prepared(x: torch.Tensor, qweight_tiled: torch.Tensor, scale: torch.Tensor,
                       zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """:func:`w4a8_gemm` on :func:`w4a16_prepare_cpu`'s tensors."""
    return w4a8_gemm(x, w4a16_untile_cpu(qweight_tiled), scale, zeros, group_size)


# The weight-row-lane layout of w4a8_gemm_lanes (csrc/cpu/w4a8_lanes.cpp), the form the
# runtime prepares an int8-activation int4 linear in on CPUs with AVX-512 VNNI: per tile
# of 16 rows, per chunk of 64 k (8 words a row), per word j, the 16 rows' words j side by
# side, so one 64-byte load holds a word of every row of the tile (rows past N are zero).
# The group metadata goes by tile too, [tiles, K / group_size, 16] (a tile's metadata is
# contiguous): fp32 scales, uint8 zero points; the ops take N as an argument.
W4_LANE_ROWS = 16


def w4a8_lanes_supported(k: int, group_size: int) -> bool:
    """Whether :func:`w4a8_prepare_lanes` takes a linear: K a multiple of 64 and an
    int8-activation group size (:func:`w4a8_group_supported`)."""
    return k % 64 == 0 and w4a8_group_supported(group_size) and k % group_size == 0


def _tiles_of_rows(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """``[N, G']`` -> ``[tiles, G', 16]``, rows past N zero."""
    out = torch.zeros(tiles * W4_LANE_ROWS, t.shape[1], dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out.reshape(tiles, W4_LANE_ROWS, t.shape[1]).permute(0, 2, 1).contiguous()


def w4a8_prepare_lanes(qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical int32 ``[N, K/8]``, scales / zeros ``[N, K/G]`` -> the lanes form: int32
    ``[ceil(N/16), 2K]`` (tile, chunk, word, row), fp32 scale and uint8 zeros
    ``[ceil(N/16), K/G, 16]`` (rows past N zero)."""
    n, words = qweight.shape
    if (words * 8) % 64:
        raise ValueError(f"the lanes layout needs K divisible by 64, got K={words * 8}")
    tiles = -(-n // W4_LANE_ROWS)
    q = torch.zeros(tiles * W4_LANE_ROWS, words, dtype=torch.int32, device=qweight.device)
    q[:n] = qweight
    q = q.reshape(tiles, W4_LANE_ROWS, words // 8, 8).permute(0, 2, 3, 1).reshape(tiles, words * W4_LANE_ROWS)
    return (q.contiguous(), _tiles_of_rows(scales.to(torch.float32), tiles),
            _tiles_of_rows(zeros.to(torch.uint8), tiles))


def w4a8_unprepare_lanes(q_lanes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`w4a8_prepare_lanes`'s qweight: back to the canonical ``[n, K/8]``."""
    tiles, width = q_lanes.shape
    words = width // W4_LANE_ROWS
    q = q_lanes.reshape(tiles, words // 8, 8, W4_LANE_ROWS).permute(0, 3, 1, 2).reshape(tiles * W4_LANE_ROWS, words)
    return q[:n].contiguous()


def lanes_metadata_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of the lanes form's scales / zeros: ``[tiles, K/G, 16]`` -> ``[n, K/G]``."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n]


def w4a16_lanes_supported(k: int, group_size: int) -> bool:
    """Whether the float-activation op takes a linear in the lanes layout
    (``w4a16_gemm_lanes``): K a multiple of 64, groups of whole words (8 k)."""
    return k % 64 == 0 and group_size % 8 == 0 and k % group_size == 0


def w4a16_gemm_lanes(x: torch.Tensor, q_lanes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, n: int) -> torch.Tensor:
    """:func:`w4a16_gemm` on :func:`w4a8_prepare_lanes`'s tensors (``n`` outputs)."""
    return w4a16_gemm(x, w4a8_unprepare_lanes(q_lanes, n), lanes_metadata_rows(scale, n),
                      lanes_metadata_rows(zeros, n), group_size)


def w4a8_gemm_lanes(x: torch.Tensor, q_lanes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, n: int) -> torch.Tensor:
    """:func:`w4a8_gemm` on :func:`w4a8_prepare_lanes`'s tensors (``n`` outputs)."""
    return w4a8_gemm(x, w4a8_unprepare_lanes(q_lanes, n), lanes_metadata_rows(scale, n),
                     lanes_metadata_rows(zeros, n), group_size)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``x ≈ q * scale[:, None]``; returns (int8 [M,K], fp32 [M])."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1).clamp_min(1e-10) / INT8_MAX
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def w8a8_gemm(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic int8 activations times per-channel int8 weights, int32 accumulate."""
    qx, sx = quantize_per_token_int8(x)
    # int32 accumulation is exact in float64 for any K below 2**31 / 127**2 * 2**21.
    acc = qx.to(torch.float64) @ qweight.to(torch.float64).t()
    y = acc.to(torch.float32) * sx.unsqueeze(-1) * weight_scale.to(torch.float32).unsqueeze(0)
    return y.to(x.dtype)


def w8a8_outlier_gemm(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                      outlier_idx: torch.Tensor, outlier_weight: torch.Tensor) -> torch.Tensor:
    """LLM.int8() decomposition: outlier input columns in float, the rest in W8A8.

    ``outlier_idx`` int64 ``[C]``, ``outlier_weight`` ``[N, C]`` holds the unquantized
    weight columns. The int8 weight's entries at those columns are ignored.
    """
    idx = outlier_idx.to(torch.long)
    x_rest = x.clone()
    x_rest[:, idx] = 0
    y = w8a8_gemm(x_rest, qweight, weight_scale).to(torch.float32)
    y = y + x[:, idx].to(torch.float32) @ outlier_weight.to(torch.float32).t()
    return y.to(x.dtype)


def w8a8_tile_cpu(qweight: torch.Tensor) -> torch.Tensor:
    """Load-time int8 weight layout of the CPU kernel: canonical ``[N, K]`` with each group
    of 4 rows chunk-interleaved (chunk = 64 k): row r's chunk c of a tile at bytes
    ``256 c + 64 r`` of that tile's ``4 K``. Rows past the last full tile (and all rows
    when K % 64 != 0) stay row-major. Same shape and dtype."""
    return _cpu_tile(qweight, W8_CPU_TILE_CHUNK)


def w8a8_untile_cpu(qweight_tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`w8a8_tile_cpu`."""
    return _cpu_tile(qweight_tiled, W8_CPU_TILE_CHUNK, untile=True)


W8_LANES_MAX_K = 65536   # (q + 128) . w of a row stays inside int32: K x 255 x 127 < 2**31


def w8a8_prepare_lanes(qweight: torch.Tensor, weight_scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical int8 ``[N, K]`` and per-channel scales ``[N]`` -> the weight-row-lane form
    of the CPU W8A8 op (``w8a8_gemm_lanes``): int8 ``[ceil(N/16), ceil(K/4) * 64]`` (per
    tile of 16 rows, per 4-k quad j, the 16 rows' 4 bytes side by side: byte
    ``64 j + 4 r + i`` is ``w[16 t + r, 4 j + i]``), fp32 scales ``[ceil(N/16), 16]`` and
    int32 row sums ``[ceil(N/16), 16]`` (the kernel dots ``q + 128`` as unsigned bytes and
    takes ``128 x`` the row sum back off). Rows past N and k past K are zero."""
    n, k = qweight.shape
    if k > W8_LANES_MAX_K:
        raise ValueError(f"the W8A8 lanes layout takes K <= {W8_LANES_MAX_K}, got K={k}")
    tiles, quads = -(-n // W4_LANE_ROWS), -(-k // 4)
    w = torch.zeros(tiles * W4_LANE_ROWS, quads * 4, dtype=torch.int8, device=qweight.device)
    w[:n, :k] = qweight
    q = w.reshape(tiles, W4_LANE_ROWS, quads, 4).permute(0, 2, 1, 3).reshape(tiles, quads * 64)
    rowsum = w.to(torch.int32).sum(dim=1, dtype=torch.int32).reshape(tiles, W4_LANE_ROWS)
    scale = torch.zeros(tiles * W4_LANE_ROWS, dtype=torch.float32, device=qweight.device)
    scale[:n] = weight_scale.to(torch.float32)
    return q.contiguous(), scale.reshape(tiles, W4_LANE_ROWS), rowsum.contiguous()


def w8a8_unprepare_lanes(q_lanes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`w8a8_prepare_lanes`'s weights: back to the canonical ``[n, k]``."""
    tiles, width = q_lanes.shape
    quads = width // 64
    w = q_lanes.reshape(tiles, quads, W4_LANE_ROWS, 4).permute(0, 2, 1, 3).reshape(tiles * W4_LANE_ROWS, quads * 4)
    return w[:n, :k].contiguous()


def w8a8_gemm_lanes(x: torch.Tensor, q_lanes: torch.Tensor, scale: torch.Tensor, rowsum: torch.Tensor,
                    n: int) -> torch.Tensor:
    """:func:`w8a8_gemm` on :func:`w8a8_prepare_lanes`'s tensors (``n`` outputs; K is x's)."""
    return w8a8_gemm(x, w8a8_unprepare_lanes(q_lanes, n, x.shape[-1]), scale.reshape(-1)[:n])


def w8a8_gemm_prepared(x: torch.Tensor, qweight_tiled: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """:func:`w8a8_gemm` on :func:`w8a8_tile_cpu`'s weights."""
    return w8a8_gemm(x, w8a8_untile_cpu(qweight_tiled), weight_scale)


def w8a8_outlier_gemm_prepared(x: torch.Tensor, qweight_tiled: torch.Tensor, weight_scale: torch.Tensor,
                               outlier_idx: torch.Tensor, outlier_weight: torch.Tensor,
                               threshold: float | None = None) -> torch.Tensor:
    """:func:`w8a8_outlier_gemm` on :func:`w8a8_tile_cpu`'s weights; with a ``threshold``,
    :func:`w8a8_outlier_gemm_guarded` (the spike guard) on them."""
    qweight = w8a8_untile_cpu(qweight_tiled)
    if threshold is None:
        return w8a8_outlier_gemm(x, qweight, weight_scale, outlier_idx, outlier_weight)
    return w8a8_outlier_gemm_guarded(x, qweight, weight_scale, outlier_idx, outlier_weight, threshold)


def w8a8_outlier_gemm_guarded(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                              outlier_idx: torch.Tensor, outlier_weight: torch.Tensor, threshold: float,
                              gemm=w8a8_outlier_gemm) -> torch.Tensor:
    """The static decomposition plus a spike guard: any column outside ``outlier_idx`` that
    reaches ``threshold`` in this batch leaves the int8 path (it would blow up the per-token
    scale) and is computed in float against its dequantized int8 weight column (the
    bitsandbytes rule). ``gemm`` is the static op that runs the rest (the reference, or
    the dispatcher op a runtime layer uses). Without a spike this is exactly ``gemm``."""
    idx = outlier_idx.to(torch.long)
    col_max = x.abs().amax(dim=0)
    col_max[idx] = 0
    extra = torch.nonzero(col_max >= threshold).flatten()
    if extra.numel() == 0:
        return gemm(x, qweight, weight_scale, outlier_idx, outlier_weight)
    x_rest = x.clone()
    x_rest[:, extra] = 0
    w_extra = qweight[:, extra].to(torch.float32) * weight_scale.to(torch.float32).unsqueeze(1)
    y = gemm(x_rest, qweight, weight_scale, outlier_idx, outlier_weight).to(torch.float32)
    return (y + x[:, extra].to(torch.float32) @ w_extra.t()).to(x.dtype)


# --- CUDA W4A16 fragment-order layout (csrc/cuda/int4_layout.cuh) -------------------
# Made once at load time for the tensor-core kernel: N padded to a multiple of 128, K to
# 64; int32 words [Np/16, Kp/64, 32 lanes, 4 k16-steps] (returned as [Np/16, Kp*2]);
# nibble p of word (nt, kb, lane, ks) is the weight at
#   n = 16*nt + 8*((p>>1)&1) + lane//4,  k = 64*kb + 16*ks + 2*(lane%4) + (p>>2) + 8*(p&1)
# (the B operand of two mma.m16n8k16 per lane). Scales / zeros transposed to [Gp, Np].
W4_CUDA_TILE_N, W4_CUDA_TILE_K = 128, 64


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _w4_cuda_coords(np_: int, kp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    nt, kb = ar(np_ // 16).view(-1, 1, 1, 1, 1), ar(kp // 64).view(1, -1, 1, 1, 1)
    lane, ks, p = ar(32).view(1, 1, -1, 1, 1), ar(4).view(1, 1, 1, -1, 1), ar(8).view(1, 1, 1, 1, -1)
    n = 16 * nt + 8 * ((p >> 1) & 1) + lane // 4
    k = 64 * kb + 16 * ks + 2 * (lane % 4) + (p >> 2) + 8 * (p & 1)
    return torch.broadcast_tensors(n, k)


def w4a16_shuffle_for_cuda(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical int4 -> (qweight_shuffled int32 [Np/16, Kp*2], scales_t [Gp, Np], zeros_t
    uint8 [Gp, Np]); padding is zero (weights, scales and zeros)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    np_, kp = _round_up(n, W4_CUDA_TILE_N), _round_up(k, W4_CUDA_TILE_K)
    gp = -(-kp // group_size)
    u = torch.zeros(np_, kp, dtype=torch.int64, device=qweight.device)
    u[:n, :k] = unpack_int4(qweight).to(torch.int64)
    rows, cols = _w4_cuda_coords(np_, kp, qweight.device)
    shifts = 4 * torch.arange(8, device=qweight.device, dtype=torch.int64)
    words = (u[rows, cols] << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(np_ // 16, kp * 2)
    scales_t = scales.new_zeros(gp, np_)
    scales_t[: scales.shape[1], :n] = scales.t()
    zeros_t = torch.zeros(gp, np_, dtype=torch.uint8, device=zeros.device)
    zeros_t[: zeros.shape[1], :n] = zeros.t()
    return words, scales_t, zeros_t


def w4a16_unshuffle_cuda(qweight_shuffled: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                         n: int, k: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`w4a16_shuffle_for_cuda` (canonical qweight, scales, zeros)."""
    np_, kp = qweight_shuffled.shape[0] * 16, qweight_shuffled.shape[1] // 2
    rows, cols = _w4_cuda_coords(np_, kp, qweight_shuffled.device)
    words = qweight_shuffled.reshape(np_ // 16, kp // 64, 32, 4, 1).to(torch.int64)
    nib = (words >> (4 * torch.arange(8, device=words.device))) & 0xF
    u = torch.zeros(np_, kp, dtype=torch.uint8, device=words.device)
    u[rows.reshape(-1), cols.reshape(-1)] = nib.reshape(-1).to(torch.uint8)
    g = k // group_size
    return pack_int4(u[:n, :k]), scales_t[:g, :n].t().contiguous(), zeros_t[:g, :n].t().contiguous()


def w4a16_gemm_shuffled(x: torch.Tensor, qweight_shuffled: torch.Tensor, scales_t: torch.Tensor,
                        zeros_t: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    """:func:`w4a16_gemm` on the CUDA fragment-order layout; ``n`` = out features."""
    qweight, scales, zeros = w4a16_unshuffle_cuda(qweight_shuffled, scales_t, zeros_t, n, x.shape[1], group_size)
    return w4a16_gemm(x, qweight, scales, zeros, group_size)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``: normalised in fp32, rounded to x's dtype, then scaled."""
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last dim, int64 ``x.shape[:-1]``: the first
    one on ties, and the first NaN where a row has any (``torch.argmax``'s rule)."""
    return x.argmax(dim=-1)


def dense_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` in ``x``'s dtype (the weight cast to it)."""
    return x @ weight.to(x.dtype).t()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a block's residual add and the next norm."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row: ``q [B, Hq, D]`` over ``k, v [B, Hkv, S, D]`` (query head h reads
    kv head ``h // (Hq / Hkv)``), ``mask [B|1, S]`` True where a key may be attended;
    scaled by ``1/sqrt(D)``. Returns ``[B, Hq * D]``. Every row must see at least one key.
    ``k``/``v`` may be float16 (a half-size KV cache) under a float32 / bfloat16 ``q``."""
    b, hq, d = q.shape
    k, v = k.to(q.dtype), v.to(q.dtype)
    am = None if mask is None else mask.to(torch.bool)[:, None, None, :]
    y = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=am,
                                                         enable_gqa=hq != k.shape[1])
    return y.reshape(b, hq * d)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """One query per row over a paged KV cache: ``q [B, Hq, D]``; ``k_pool``/``v_pool``
    ``[num_blocks, Hkv, block_size, D]`` (float32, bfloat16 or float16, any of them under
    a float32 / bfloat16 ``q``; or int8 rows ``[..., D + 4]``, ``kv_int8.py``); row r's key
    at position p lives in block ``block_tables[r, p // block_size]`` (int32 ``[B, M]``) at
    offset ``p % block_size``.
    Row r attends to its keys ``0 .. context_lens[r] - 1`` (int32 ``[B]``, each >= 1), and
    with ``window > 0`` only to the last ``window`` of them (0 = full attention). Query
    head h reads kv head ``h // (Hq / Hkv)``; scores ``q . k / sqrt(D)`` and the softmax in
    float32; returns ``[B, Hq, D]`` rounded to q's dtype. Table entries past a row's
    context are never read (they may hold anything)."""
    b, hq, d = q.shape
    nb, hkv, bs, dk = k_pool.shape
    if v_pool.shape != k_pool.shape or dk != kv_int8.row_elems(d, k_pool.dtype) or hkv == 0 or hq % hkv != 0:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} does not fit k_pool {tuple(k_pool.shape)} / "
                         f"v_pool {tuple(v_pool.shape)} (head_dim, or Hq % Hkv)")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"paged_decode_attention: block_tables must be [B, M] and context_lens [B] with B = {b}, "
                         f"got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if window < 0:
        raise ValueError(f"paged_decode_attention: window must be >= 0 (0 = full attention), got {window}")
    lens = context_lens.to(torch.long)
    if b == 0:
        return q.new_empty(q.shape)
    if int(lens.min()) < 1 or int(lens.max()) > block_tables.shape[1] * bs:
        raise ValueError(f"paged_decode_attention: context_lens must be in 1..M * block_size = "
                         f"{block_tables.shape[1] * bs}, got {lens.tolist()}")
    s = int(lens.max())
    pos = torch.arange(s, device=q.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [B, S]
    if window > 0:
        valid &= pos.unsqueeze(0) >= (lens - window).unsqueeze(1)
    blocks = block_tables.to(torch.long)[:, pos // bs]
    blocks = torch.where(valid, blocks, torch.zeros_like(blocks))  # unused entries may be anything
    if int(blocks.min()) < 0 or int(blocks.max()) >= nb:
        raise ValueError(f"paged_decode_attention: a block table entry in use is outside 0..{nb - 1}")
    offsets = (pos % bs).expand(b, s)
    k = kv_int8.from_pool(k_pool[blocks, :, offsets], torch.float32)  # [B, S, Hkv, D]
    v = kv_int8.from_pool(v_pool[blocks, :, offsets], torch.float32)
    group = hq // hkv
    qf = q.to(torch.float32).view(b, hkv, group, d)
    scores = torch.einsum("bhgd,bshd->bhgs", qf, k) / math.sqrt(d)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v)
    return out.reshape(b, hq, d).to(q.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, over the last dim: ``x * cos +
    rotate_half(x) * sin`` (``cos``/``sin`` broadcast against ``x``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# the forms of a linear the native decode step (compress._C.DecodePlan, csrc/cpu/decode_layer.cpp)
# takes, as the runtime's layers name them in decode_spec(), and how many tensors each brings
# (llm_int8_guarded_prepared: the fifth is the spike guard's threshold, a 0-dim fp32 tensor)
DECODE_LAYER_TENSORS = {"w4a16_prepared": 3, "w4a8_prepared": 3, "w4a16_lanes": 4, "w4a8_lanes": 4, "w8a8_prepared": 2,
                        "w8a8_lanes": 4,
                        "llm_int8_prepared": 4, "llm_int8_guarded_prepared": 5, "dense": 1}


def stream_read_sum(buf: torch.Tensor) -> torch.Tensor:
    """Wrapping int64 sum of an int64 buffer (the bandwidth probe's checksum)."""
    if buf.dtype != torch.int64:
        raise TypeError(f"stream_read_sum needs an int64 buffer, got {buf.dtype}")
    return buf.reshape(-1).sum()
