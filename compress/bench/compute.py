"""Arithmetic ceiling of this CPU for the instruction mixes the GEMM tiles use, measured
with ``compress._C.compute_peak`` (register-only loops on every intra-op thread): the
compute counterpart of :mod:`compress.bench.bandwidth`, and the physical limit for
large M. The int8 / fp32 ratio of the two peaks bounds what an int8 GEMM can gain over
an ideal fp32 GEMM on this CPU."""
from __future__ import annotations

import statistics
import time

import torch

from compress import ops

# multiply-accumulates per loop step of each recipe (csrc/cpu/compute_peak.cpp)
MACS_PER_STEP = {"fp32_fma": 96, "int8_avx2": 256, "int16_avx2": 192, "int8_vnni": 1024,
                 "int8_vnni_panel": 768, "fp32_fma512": 192, "amx_int8": 65536}
RECIPE_ISA = {"fp32_fma": "avx2", "int8_avx2": "avx2", "int16_avx2": "avx2", "int8_vnni": "avx512_vnni",
              "int8_vnni_panel": "avx512_vnni", "fp32_fma512": "avx512_vnni", "amx_int8": "avx512_vnni"}
FP32_RECIPES = ("fp32_fma512", "fp32_fma")  # best first: what an fp32 sgemm can reach


def available_recipes() -> list[str]:
    """Recipes the CPU can run: our tiles' within the current ISA cap (amx_int8 also
    needs AMX-INT8 that the OS lets this process use); the fp32 ones whatever the cap,
    being the ceiling of the fp32 matmul we are compared with."""
    if not ops.native_available("cpu"):
        return []
    have = ops.cpu_isas_available()  # best first, down to scalar
    active = have.index(ops.cpu_isa())  # the ISA cap counts
    return [r for r, isa in RECIPE_ISA.items() if isa in have and (r in FP32_RECIPES or have.index(isa) >= active)
            and (r != "amx_int8" or ops.w8a8_amx_available())]


def fp32_peak(peaks: dict) -> tuple[str, dict] | tuple[None, None]:
    """The best fp32 FMA recipe among ``peaks`` (AVX-512 where measured, else AVX2)."""
    for recipe in FP32_RECIPES:
        if recipe in peaks:
            return recipe, peaks[recipe]
    return None, None


def w8a8_recipe(m: int, isa: str, int16_min_rows: int, amx_min_rows: int | None = None) -> str | None:
    """The recipe whose instruction mix the W8A8 ops run at ``m`` rows with ``isa`` active
    (csrc/cpu/w8a8_kernel.cpp): with AVX-512 VNNI the AMX tiles from ``amx_min_rows``
    rows (None: no AMX) and two, else the VNNI tiles; on AVX2 the int16 GEMM from
    ``int16_min_rows`` rows, else the byte tiles; None for the scalar path."""
    if isa == "avx512_vnni":
        return "amx_int8" if amx_min_rows is not None and m >= max(2, amx_min_rows) else "int8_vnni"
    if isa == "avx2":
        return "int16_avx2" if m >= int16_min_rows else "int8_avx2"
    return None


def compute_peak(recipe: str, seconds: float = 0.05, reps: int = 5) -> dict:
    """Median GMAC/s (1e9 multiply-accumulates per second) of ``recipe`` over ``reps``
    runs of about ``seconds`` each, with torch's current thread count."""
    if recipe not in MACS_PER_STEP:
        raise ValueError(f"unknown compute recipe {recipe!r}; choose one of {sorted(MACS_PER_STEP)}")
    c = ops._cpu_module()
    threads = torch.get_num_threads()
    c.compute_peak(recipe, 10_000)  # warm up (and wake the pool)
    t0 = time.perf_counter()
    c.compute_peak(recipe, 100_000)
    per_step = (time.perf_counter() - t0) / 100_000
    iters = int(min(1 << 24, max(10_000, seconds / max(per_step, 1e-12))))
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        macs = c.compute_peak(recipe, iters)
        dt = time.perf_counter() - t0
        expected = MACS_PER_STEP[recipe] * iters * threads
        if macs != expected:
            raise RuntimeError(f"compute_peak({recipe}) did {macs} multiply-accumulates, expected {expected}")
        rates.append(macs / dt / 1e9)
    return {"recipe": recipe, "threads": threads, "iters": iters,
            "median_gmacs": statistics.median(rates), "best_gmacs": max(rates)}


def compute_peaks() -> dict[str, dict]:
    """:func:`compute_peak` of every recipe this CPU can run."""
    return {r: compute_peak(r) for r in available_recipes()}
