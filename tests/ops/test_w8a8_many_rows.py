"""The W8A8 ops' many-row paths: the int16 GEMM on AVX2 (csrc/cpu/w8a8_i16_avx2.inc) and
the AMX-INT8 tiles at the avx512_vnni level (csrc/cpu/w8a8_amx.inc) must give the bits of
the tiles they replace (the byte tiles, the VNNI tiles), whatever the batch."""
from __future__ import annotations

import contextlib

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int8

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")

NEVER = 1 << 62


@contextlib.contextmanager
def few_row_tiles_only():
    """Both many-row paths off: every call on the tiles a one- or two-row call takes."""
    int16, amx = ops.set_w8a8_int16_min_rows(NEVER), ops.set_w8a8_amx_min_rows(NEVER)
    try:
        yield
    finally:
        ops.set_w8a8_int16_min_rows(int16)
        ops.set_w8a8_amx_min_rows(amx)


def calls_for(n: int, k: int):
    q, s = make_int8(n, k)
    tiled = reference.w8a8_tile_cpu(q)
    idx, ow = torch.tensor([1, k // 3]), torch.randn(n, 2)
    return {
        "canonical": lambda xx: torch.ops.compress.w8a8_gemm(xx, q, s),
        "prepared": lambda xx: torch.ops.compress.w8a8_gemm_prepared(xx, tiled, s),
        "outlier": lambda xx: torch.ops.compress.w8a8_outlier_gemm_prepared(xx, tiled, s, idx, ow),
        "bf16": lambda xx: torch.ops.compress.w8a8_gemm_prepared(xx.bfloat16(), tiled, s),
    }


# (M, N, K): M at both paths' threshold (16), past the int16 GEMM's 6-row tiles (4- and
# 1-row tails) and past whole 32-token AMX blocks (a last block of 16); N not a multiple
# of 16 (nor of 4, nor of the AMX panels' 32), and N of 10 int16 panels (three grabs of 4
# from the threads' shared counter); K with a row-major tail (K % 64 != 0), and K over two
# of the int16 GEMM's 8192-wide blocks.
@pytest.mark.parametrize("shape", [(16, 24, 128), (23, 150, 192), (64, 37, 100), (70, 50, 256), (67, 20, 8200),
                                   (64, 16, 8256), (48, 97, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_w8a8_rows_do_not_depend_on_the_batch(isa, shape):
    """Every row of a many-row call equals the same row computed in a two-row call, bit
    for bit, and the many-row call equals itself with both many-row paths off: on AVX2 it
    takes the int16 GEMM, with AMX the tile matrix multiplies, and both must form the
    exact int32 sums of the tiles they replace and round them the same way. (Two rows,
    not one: a one-row call adds fused outliers in the tile epilogue, whose float sums
    round differently from the many-row pass.)"""
    m, n, k = shape
    x = torch.randn(m, k)
    for name, call in calls_for(n, k).items():
        whole = call(x)
        alone = torch.cat([call(x[[i, min(i + 1, m - 1)]])[: m - i] for i in range(0, m, 2)])
        assert torch.equal(whole, alone), f"{name}: max diff {(whole - alone).abs().max().item()}"
        with few_row_tiles_only():
            few_rows = call(x)
        assert torch.equal(whole, few_rows), f"{name}: max diff {(whole - few_rows).abs().max().item()}"


@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 33, 100])
def test_w8a8_amx_threshold_at_one_row_keeps_the_bits(isa, m):
    """With the AMX threshold at one row, a CPU with AMX takes the tiles for every call of
    two rows or more (every partial 16-token block among them; one row stays on the VNNI
    tiles, whose epilogue adds fused outliers) and still gives the VNNI tiles' bits; other
    CPUs, and the AVX2 / scalar levels, ignore the knob."""
    x = torch.randn(m, 320)
    calls = calls_for(45, 320)
    before = ops.set_w8a8_amx_min_rows(1)
    try:
        amx = {name: call(x) for name, call in calls.items()}
    finally:
        ops.set_w8a8_amx_min_rows(before)
    with few_row_tiles_only():
        for name, call in calls.items():
            vnni = call(x)
            assert torch.equal(amx[name], vnni), f"{name}: max diff {(amx[name] - vnni).abs().max().item()}"


@pytest.mark.parametrize("setter", ["set_w8a8_int16_min_rows", "set_w8a8_amx_min_rows"])
def test_many_row_thresholds_are_checked_and_restorable(setter):
    set_rows = getattr(ops, setter)
    before = set_rows(7)
    assert set_rows(before) == 7
    with pytest.raises(ValueError, match="rows must be >= 1"):
        set_rows(0)
