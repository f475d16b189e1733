"""The CUDA host harness (csrc/cuda/tests/host_harness.cu) built by nvcc into a shared
library (cached under build/cuda_host/<source hash>/ by native_harness.py) and loaded
through ctypes, for the host tests of the CUDA kernels' helpers and argument checks."""
from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest
import torch

from native_harness import REPO, build_cached_library

CUDA_DIR = REPO / "csrc" / "cuda"
HARNESS = CUDA_DIR / "tests" / "host_harness.cu"
HEADERS = ("cpk_common.cuh", "int4_layout.cuh", "w4a16_tile.cuh", "w8a8_tile.cuh", "op_checks.h",
           "paged_attention.cuh")


def nvcc_path() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def build_harness() -> Path:
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC or install the CUDA toolkit): CUDA host tests skipped")
    return build_cached_library(
        "cuda_host", [HARNESS, HARNESS.parent / "paged_attention_emulated.h"]
        + [CUDA_DIR / name for name in HEADERS],
        lambda out: [nvcc, "-std=c++17", "-O2", "-arch=sm_80", "-Werror", "all-warnings",
                     "-Xcompiler", "-fPIC,-Wall,-Werror", "-shared", str(HARNESS), "-o", str(out)])


def load_harness() -> ctypes.CDLL:
    return ctypes.CDLL(str(build_harness()))


def ptr(t: torch.Tensor):
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())
