"""Fixtures of the op tests: a fixed seed, and every ISA this machine has (the best one,
forced AVX2, forced scalar). Random quantized weights come from ``int_weights``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import compress.ops as ops

sys.path.insert(0, str(Path(__file__).parent))

ISAS = ops.cpu_isas_available() if ops.native_available("cpu") else []


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # SQNR of tiny shapes varies with the draw: keep tests deterministic


@pytest.fixture(params=ISAS)
def isa(request):
    with ops.force_cpu_isa(request.param):
        yield request.param
