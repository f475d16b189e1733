"""The compute-peak probe (compress._C.compute_peak, compress.bench.compute) and the
large-M summary of `compress bench kernels` that holds int8 results against it."""
from __future__ import annotations

import importlib

import pytest
import torch

import compress.ops as ops
from compress.bench import compute, kernels

native = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_probe_does_exactly_the_counted_work(threads):
    c = importlib.import_module("compress._C")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for recipe in compute.available_recipes():
            assert c.compute_peak(recipe, 1234) == compute.MACS_PER_STEP[recipe] * 1234 * threads
            assert c.compute_peak(recipe, 0) == 0
    finally:
        torch.set_num_threads(old)


@native
def test_probe_rejects_bad_input():
    c = importlib.import_module("compress._C")
    with pytest.raises(ValueError, match="int9_avx2.*unknown recipe.*int16_avx2"):
        c.compute_peak("int9_avx2", 10)
    with pytest.raises(ValueError, match="iters"):
        c.compute_peak("fp32_fma", 1 << 25)
    with pytest.raises(ValueError, match="unknown compute recipe"):
        compute.compute_peak("bf16_dot")
    if "avx512_vnni" not in ops.cpu_isas_available():
        with pytest.raises(RuntimeError, match="int8_vnni needs AVX-512 VNNI"):
            c.compute_peak("int8_vnni", 10)
        with pytest.raises(RuntimeError, match="fp32_fma512 needs AVX-512"):
            c.compute_peak("fp32_fma512", 10)
    if not ops.w8a8_amx_available():
        with pytest.raises(RuntimeError, match="amx_int8 needs AMX-INT8"):
            c.compute_peak("amx_int8", 10)
    with ops.force_cpu_isa("avx2"):  # AMX rides on the AVX-512 level: a cap below it turns it off
        assert "amx_int8" not in compute.available_recipes()
        assert "int8_vnni" not in compute.available_recipes()
        # the fp32 matmul is not capped: its AVX-512 ceiling stays where the CPU has it
        assert ("fp32_fma512" in compute.available_recipes()) == ("avx512_vnni" in ops.cpu_isas_available())


@native
def test_scalar_cap_leaves_only_the_fp32_ceilings():
    """Under a scalar cap our tiles' recipes are gone, and the fp32 ones (the baseline
    matmul's ceiling, which no cap of ours limits) stay where the CPU has them."""
    c = importlib.import_module("compress._C")
    have = ops.cpu_isas_available()
    with ops.force_cpu_isa("scalar"):
        expected = [r for r in ("fp32_fma", "fp32_fma512") if compute.RECIPE_ISA[r] in have]
        assert compute.available_recipes() == expected
        if "avx2" in have:
            with pytest.raises(RuntimeError, match="int8_avx2 needs AVX2"):
                c.compute_peak("int8_avx2", 10)
            assert c.compute_peak("fp32_fma", 10) == compute.MACS_PER_STEP["fp32_fma"] * 10 * torch.get_num_threads()


@native
@pytest.mark.skipif("avx2" not in (ops.cpu_isas_available() if ops.native_available("cpu") else []),
                    reason="no AVX2")
def test_peak_reports_a_positive_rate():
    p = compute.compute_peak("int8_avx2", seconds=0.002, reps=3)
    assert p["median_gmacs"] > 0 and p["best_gmacs"] >= p["median_gmacs"] and p["threads"] == torch.get_num_threads()


def _rec(impl, m, seconds, op="w8a8", n=64, k=64):
    flops = 2 * m * n * k
    return kernels.Record(op, impl, m, n, k, seconds, n * k, n * k / seconds / 1e9, flops / seconds / 1e9)


def test_large_m_summary_ratios_peaks_and_verdict():
    m, n, k = 64, 64, 64
    macs = m * n * k
    # fp32 matmul at 1 GMAC/s, ours at 3 GMAC/s (3x); peaks: fp32 2, byte tiles 4, int16 6 GMAC/s
    records = [_rec("torch matmul fp32", m, macs / 1e9, op="dense"), _rec("compress fp32", m, macs / 3e9),
               _rec("compress fp32", 4, 1.0)]  # M < 64: not summarised
    peaks = {"fp32_fma": {"median_gmacs": 2.0}, "int8_avx2": {"median_gmacs": 4.0},
             "int16_avx2": {"median_gmacs": 6.0}}
    lines = []
    # M = 64 below the int16 threshold: the byte tiles' peak
    kernels._large_m_summary(records, peaks, lines.append, isa="avx2", int16_min_rows=65)
    assert len(lines) == 2
    assert "3.0 GMAC/s" in lines[0] and "75% of the int8_avx2 peak" in lines[0] and "3.00x fp32 matmul" in lines[0]
    assert "50% of the fp32_fma peak" in lines[0] and "compute peak / fp32_fma peak" in lines[1]
    assert "3.00-3.00x over 1 cases" in lines[1] and "met" in lines[1] and "int8_avx2 2.00" in lines[1]
    # from the threshold on: the int16 GEMM's peak
    lines.clear()
    kernels._large_m_summary(records, peaks, lines.append, isa="avx2", int16_min_rows=64)
    assert "50% of the int16_avx2 peak" in lines[0] and "int16_avx2 3.00" in lines[1] and "int8_avx2" not in lines[1]
    # AVX-512 with AMX: the AMX peak from its threshold, the VNNI tiles' below it (or with
    # no AMX); fp32 matmul held against the AVX-512 FMA peak, the best fp32 recipe measured
    peaks.update({"fp32_fma512": {"median_gmacs": 4.0}, "int8_vnni": {"median_gmacs": 5.0},
                  "amx_int8": {"median_gmacs": 12.0}})
    lines.clear()
    kernels._large_m_summary(records, peaks, lines.append, isa="avx512_vnni", int16_min_rows=1, amx_min_rows=16)
    assert "25% of the amx_int8 peak" in lines[0] and "25% of the fp32_fma512 peak" in lines[0]
    assert "compute peak / fp32_fma512 peak on this CPU: amx_int8 3.00" in lines[1]
    lines.clear()
    kernels._large_m_summary(records, peaks, lines.append, isa="avx512_vnni", int16_min_rows=1, amx_min_rows=None)
    assert "60% of the int8_vnni peak" in lines[0] and "int8_vnni 1.25" in lines[1]
    lines.clear()
    kernels._large_m_summary([records[0], _rec("compress fp32", m, macs / 1.5e9)], {}, lines.append,
                             isa="avx2", int16_min_rows=32)
    assert "1.50-1.50x" in lines[-1] and "missed" in lines[-1] and "peak" not in lines[-1]


def test_w8a8_recipe_follows_the_kernel_paths():
    assert compute.w8a8_recipe(64, "avx512_vnni", 32) == "int8_vnni"
    assert compute.w8a8_recipe(64, "avx512_vnni", 32, amx_min_rows=16) == "amx_int8"
    assert compute.w8a8_recipe(15, "avx512_vnni", 32, amx_min_rows=16) == "int8_vnni"
    assert compute.w8a8_recipe(1, "avx512_vnni", 32, amx_min_rows=1) == "int8_vnni"  # never one row
    assert compute.w8a8_recipe(64, "avx2", 32, amx_min_rows=16) == "int16_avx2"
    assert compute.w8a8_recipe(31, "avx2", 32) == "int8_avx2"
    assert compute.w8a8_recipe(32, "avx2", 32) == "int16_avx2"
    assert compute.w8a8_recipe(256, "scalar", 32) is None


@native
def test_int16_min_rows_getter_follows_the_setter():
    old = ops.set_w8a8_int16_min_rows(77)
    try:
        assert ops.w8a8_int16_min_rows() == 77
    finally:
        ops.set_w8a8_int16_min_rows(old)
    assert ops.w8a8_int16_min_rows() == old
