"""The CPU kernels' AVX-512 VNNI tiles, run on a CPU without AVX-512 through SIMDe.

csrc/cpu/tests/isa_emulation.cpp includes the kernels' own tile sources and ATen-free
headers and is compiled by g++ with csrc/cpu/tests/simde_shim/ standing in for
<immintrin.h> (SIMDe's portable intrinsics; simde-py, a test dependency), into a shared
library cached under build/cpu_isa_emulation/<source hash>/ (native_harness.py) and
driven through ctypes.

What is checked:
* the emulation itself: the harness's AVX2 and scalar paths give the compiled extension's
  AVX2 / scalar results bit for bit (same tiles, same blocking), so SIMDe computes what
  the hardware computes and the harness sets the tiles up as the op does;
* the VNNI tiles: their int32 dot products are exact, so W4A16, W8A8 and the fused
  LLM.int8 op must equal the AVX2 results bit for bit (same blocking), and sit at the
  AVX2 path's SQNR against the reference (the fused op's outlier products: the tiles'
  epilogue at M = 1, one pass over the outlier weights after the tiles at M > 1, both
  the op's own code);
* the fp16 scale conversion the kernels use, over all 65,536 bit patterns.
"""
from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from compress.accuracy import sqnr_db
from native_harness import REPO, build_cached_library

CPU_DIR = REPO / "csrc" / "cpu"
HARNESS = CPU_DIR / "tests" / "isa_emulation.cpp"
SHIM = CPU_DIR / "tests" / "simde_shim"
SOURCES = [HARNESS, SHIM / "immintrin.h"] + [CPU_DIR / name for name in (
    "simd_common.h", "w4a16_common.h", "w4a16_tile.inc", "w8a8_common.h", "w8a8_tile_avx2.inc",
    "w8a8_tile_vnni.inc")]
SCALAR, AVX2, VNNI = 0, 1, 2
SCALE_TYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _simde_include() -> str:
    try:
        import simde_py
    except ImportError:
        pytest.skip("simde-py is not installed (it is in the test extra: pip install -e '.[test]')")
    return simde_py.get_include()


def _build() -> Path:
    simde = _simde_include()
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or $CXX)")
    return build_cached_library(
        "cpu_isa_emulation", SOURCES,
        lambda out: [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-Wno-psabi",
                     "-DCOMPRESS_ISA_EMULATION", f"-I{SHIM}", f"-I{simde}", f"-I{REPO / 'csrc'}", str(HARNESS),
                     "-o", str(out)],
        salt=simde)


@pytest.fixture(scope="module")
def lib():
    cdll = ctypes.CDLL(str(_build()))
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    cdll.cpk_emu_w4a16.argtypes = [ci, vp, i64, i64, vp, i64, i64, i64, vp, vp, i64, vp]
    cdll.cpk_emu_set_w4_shared_unpack.argtypes = [ci]
    cdll.cpk_emu_w8a8.argtypes = [ci, vp, i64, i64, vp, i64, i64, vp, ci, vp, i64, vp, ci, i64, vp]
    cdll.cpk_emu_half_to_float.argtypes = [ctypes.c_uint16]
    cdll.cpk_emu_half_to_float.restype = ctypes.c_float
    return cdll


def _p(t: torch.Tensor | None):
    if t is None:
        return None
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


def _native(isa: str):
    """Context that runs the compiled extension on ``isa``; skips where the CPU lacks it."""
    if not ops.native_available("cpu"):
        pytest.skip("compress._C not built")
    if isa not in ops.cpu_isas_available():
        pytest.skip(f"this CPU cannot run the {isa} kernels natively")
    return ops.force_cpu_isa(isa)


# --- W4A16 -----------------------------------------------------------------------------------

def _w4_nblock(k: int) -> int:
    """w4a16_run's n-block (rows of ~128 KiB of packed weights, a multiple of 8)."""
    return max(8, ((128 << 10) // max(1, k // 2)) // 8 * 8)


def _w4_case(m, n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    qweight = reference.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    x = torch.randn(m, k, generator=g)
    return x, qweight, scales, zeros


def _emu_w4(lib, isa, x, qweight, scale, zeros, group, tiled, nb=None):
    m, k = x.shape
    n = qweight.shape[0]
    n4 = n - n % 4 if tiled and k % 64 == 0 else 0
    y = torch.full((m, n), float("nan"))
    rc = lib.cpk_emu_w4a16(isa, _p(x), m, k, _p(qweight), n, n4, group, _p(scale), _p(zeros),
                           nb or _w4_nblock(k), _p(y))
    assert rc == 0
    return y


# (M, N, K, group): M = 1 (decode tiles), odd M and M past a 64-row block (4 x 2, 2 x 2 and
# 1 x 2 tiles), N not a multiple of 4, K == group, K % 64 == 32 (group 32, a half chunk),
# N past one n-block.
W4_SHAPES = [(1, 8, 32, 32), (3, 5, 96, 32), (7, 33, 128, 64), (1, 24, 256, 128), (17, 9, 384, 128),
             (5, 70, 192, 64), (66, 12, 64, 64), (1, 37, 512, 128), (1, 12, 128, 32), (130, 7, 256, 32),
             (2, 300, 1024, 128), (1, 262, 1024, 64)]


@pytest.mark.parametrize("shape", W4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiled", [True, False], ids=["prepared", "canonical"])
def test_w4a16_emulated_paths_match_native(lib, shape, tiled):
    """Emulated AVX2 == native AVX2 and emulated scalar == native scalar, bit for bit."""
    m, n, k, group = shape
    x, qweight, scales, zeros = _w4_case(m, n, k, group)
    if tiled:
        qw, scale, zeros8 = reference.w4a16_prepare_cpu(qweight, scales, zeros)
        op = torch.ops.compress.w4a8_gemm_prepared
    else:
        qw, scale, zeros8 = qweight, scales, zeros
        op = torch.ops.compress.w4a8_gemm
    for isa_name, isa in (("avx2", AVX2), ("scalar", SCALAR)):
        with _native(isa_name):
            native = op(x, qw, scale, zeros8, group)
        emulated = _emu_w4(lib, isa, x, qw, scale, zeros8, group, tiled)
        assert torch.equal(emulated, native), f"{isa_name}: max |diff| {(emulated - native).abs().max()}"


@pytest.mark.parametrize("shape", W4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiled", [True, False], ids=["prepared", "canonical"])
def test_w4a16_vnni_tiles_match_avx2(lib, shape, tiled):
    """vpdpbusd gives the int32 sums vpmaddubsw + vpmaddwd give (no int16 saturation at
    15 x 127 x 2), so the VNNI tiles equal the AVX2 tiles bit for bit."""
    m, n, k, group = shape
    x, qweight, scales, zeros = _w4_case(m, n, k, group, seed=1)
    qw, scale, zeros8 = (reference.w4a16_prepare_cpu(qweight, scales, zeros) if tiled
                         else (qweight, scales, zeros))
    avx2 = _emu_w4(lib, AVX2, x, qw, scale, zeros8, group, tiled)
    vnni = _emu_w4(lib, VNNI, x, qw, scale, zeros8, group, tiled)
    assert torch.equal(vnni, avx2), f"max |diff| {(vnni - avx2).abs().max()}"
    assert sqnr_db(reference.w4a16_gemm(x, qweight, scales, zeros, group), vnni) > 35


@pytest.mark.parametrize("shape", W4_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_w4a16_vnni_shared_unpack_matches_per_row_unpack(lib, shape):
    """The few-row tiles that unpack a weight chunk once for up to eight rows give the
    per-row tiles' outputs bit for bit (the same integer dots, folds and FMAs per row)."""
    m, n, k, group = shape
    x, qweight, scales, zeros = _w4_case(m, n, k, group, seed=3)
    qw, scale, zeros8 = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    before = lib.cpk_emu_set_w4_shared_unpack(0)
    try:
        per_row = _emu_w4(lib, VNNI, x, qw, scale, zeros8, group, True)
        lib.cpk_emu_set_w4_shared_unpack(1)
        shared = _emu_w4(lib, VNNI, x, qw, scale, zeros8, group, True)
    finally:
        lib.cpk_emu_set_w4_shared_unpack(before)
    assert torch.equal(shared, per_row), f"max |diff| {(shared - per_row).abs().max()}"


def test_w4a16_vnni_tiles_small_blocks(lib):
    """n-blocks of 4 and 8 rows (tile runs cut short, tiled / row-major boundary inside a
    block): the same outputs as one block per 4 rows on the AVX2 tiles, near the reference."""
    x, qweight, scales, zeros = _w4_case(5, 23, 256, 64, seed=2)
    qw, scale, zeros8 = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    ref = reference.w4a16_gemm(x, qweight, scales, zeros, 64)
    for nb in (4, 8):
        vnni = _emu_w4(lib, VNNI, x, qw, scale, zeros8, 64, True, nb=nb)
        assert torch.equal(vnni, _emu_w4(lib, AVX2, x, qw, scale, zeros8, 64, True, nb=nb))
        assert sqnr_db(ref, vnni) > 35


def test_w4a16_harness_rejects_untiled_group(lib):
    """Group sizes that are not a multiple of 32 take the op's fp32 dequantize path, not
    the tiles: the harness refuses them instead of running tiles on them."""
    x, qweight, scales, zeros = _w4_case(2, 8, 128, 16)
    y = torch.empty(2, 8)
    assert lib.cpk_emu_w4a16(VNNI, _p(x), 2, 128, _p(qweight), 8, 0, 16, _p(scales), _p(zeros), 8, _p(y)) == -1


# --- W8A8 and fused LLM.int8 -----------------------------------------------------------------

def _w8_nblock(k: int) -> int:
    """w8::run's n-block (rows of ~128 KiB of int8 weights, a multiple of 8)."""
    return max(8, ((128 << 10) // max(1, k)) // 8 * 8)


def _emu_w8(lib, isa, x, q, s, tiled, idx=None, ow=None):
    m, k = x.shape
    n = q.shape[0]
    n4 = n - n % 4 if tiled and k % 64 == 0 else 0
    c = 0 if idx is None else idx.numel()
    y = torch.full((m, n), float("nan"))
    rc = lib.cpk_emu_w8a8(isa, _p(x), m, k, _p(q), n, n4, _p(s), SCALE_TYPE[s.dtype], _p(idx), c,
                          _p(ow), SCALE_TYPE[ow.dtype] if ow is not None else 0, _w8_nblock(k), _p(y))
    assert rc == 0
    return y


# (M, N, K): M = 1, odd M, M past a 64-row block; K not a multiple of 64 (partial chunk),
# K < 64, N not a multiple of 4.
W8_SHAPES = [(1, 8, 32), (3, 5, 17), (7, 33, 100), (1, 24, 4096), (17, 9, 255), (66, 12, 64), (5, 3, 1000),
             (1, 150, 1024), (130, 10, 192)]


def _w8_case(m, n, k, c, seed=0, scale_dtype=torch.float32, ow_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(scale_dtype)
    x = torch.randn(m, k, generator=g)
    if not c:
        return x, q, s, None, None
    idx = torch.randperm(k, generator=g)[:c].sort().values
    x[:, idx] *= 20  # outlier columns
    ow = (torch.randn(n, c, generator=g) * 0.05).to(ow_dtype)
    return x, q, s, idx, ow


def _native_w8(x, q, s, tiled, idx, ow):
    qw = reference.w8a8_tile_cpu(q) if tiled else q
    if idx is None:
        op = torch.ops.compress.w8a8_gemm_prepared if tiled else torch.ops.compress.w8a8_gemm
        return op(x, qw, s)
    op = torch.ops.compress.w8a8_outlier_gemm_prepared if tiled else torch.ops.compress.w8a8_outlier_gemm
    return op(x, qw, s, idx, ow)


@pytest.mark.parametrize("shape", W8_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("outliers", [0, 1, 9])
@pytest.mark.parametrize("tiled", [True, False], ids=["prepared", "canonical"])
def test_w8a8_emulated_paths_match_native(lib, shape, outliers, tiled):
    m, n, k = shape
    x, q, s, idx, ow = _w8_case(m, n, k, min(outliers, k))
    qw = reference.w8a8_tile_cpu(q) if tiled else q
    for isa_name, isa in (("avx2", AVX2), ("scalar", SCALAR)):
        with _native(isa_name):
            native = _native_w8(x, q, s, tiled, idx, ow)
        emulated = _emu_w8(lib, isa, x, qw, s, tiled, idx, ow)
        assert torch.equal(emulated, native), f"{isa_name}: max |diff| {(emulated - native).abs().max()}"


@pytest.mark.parametrize("shape", W8_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("outliers", [0, 1, 9])
@pytest.mark.parametrize("tiled", [True, False], ids=["prepared", "canonical"])
def test_w8a8_vnni_tiles_match_avx2(lib, shape, outliers, tiled):
    """Exact int32 sums on both ISAs and the same epilogue: bit-identical outputs, also
    for the fused outlier columns; and at the reference's distance."""
    m, n, k = shape
    x, q, s, idx, ow = _w8_case(m, n, k, min(outliers, k), seed=1)
    qw = reference.w8a8_tile_cpu(q) if tiled else q
    avx2 = _emu_w8(lib, AVX2, x, qw, s, tiled, idx, ow)
    vnni = _emu_w8(lib, VNNI, x, qw, s, tiled, idx, ow)
    assert torch.equal(vnni, avx2), f"max |diff| {(vnni - avx2).abs().max()}"
    ref = reference.w8a8_gemm(x, q, s) if idx is None else reference.w8a8_outlier_gemm(x, q, s, idx, ow)
    assert sqnr_db(ref, vnni) > 80


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ow_dtype", [torch.float16, torch.bfloat16])
def test_w8a8_vnni_tiles_half_scales(lib, scale_dtype, ow_dtype):
    """fp16 / bf16 weight scales and outlier weights (the epilogue's loads) on the VNNI
    tiles, M = 1 and M = 6 (fp32 padded outliers)."""
    for m in (1, 6):
        x, q, s, idx, ow = _w8_case(m, 40, 320, 5, seed=3, scale_dtype=scale_dtype, ow_dtype=ow_dtype)
        qw = reference.w8a8_tile_cpu(q)
        vnni = _emu_w8(lib, VNNI, x, qw, s, True, idx, ow)
        with _native("avx2"):
            native = torch.ops.compress.w8a8_outlier_gemm_prepared(x, qw, s, idx, ow)
        assert torch.equal(vnni, native)
        assert sqnr_db(reference.w8a8_outlier_gemm(x, q, s, idx, ow), vnni) > 80


# --- scale conversion ------------------------------------------------------------------------

def test_half_to_float_exhaustive(lib):
    """simd_common.h's fp16 -> fp32 (the kernels' fp16 scale loads) equals torch's
    conversion for all 65,536 bit patterns (NaNs as NaNs)."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    want = bits.to(torch.int16).view(torch.float16).float()
    got = torch.tensor([lib.cpk_emu_half_to_float(int(b)) for b in bits.tolist()])
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
