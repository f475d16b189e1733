"""setup.py's TORCH_CUDA_ARCH_LIST filter (csrc/cuda/arch_list.py): the CUDA kernels need
sm_80+, so older architectures in the list are left out instead of failing the build."""
from __future__ import annotations


import pytest

from native_harness import load_build_module


@pytest.fixture(scope="module")
def arch_list():
    return load_build_module("cuda", "arch_list")


@pytest.mark.parametrize("value,kept,dropped", [
    ("7.0;7.5;8.0;8.6;9.0", "8.0;8.6;9.0", ["7.0", "7.5"]),      # a common container default
    ("6.0 6.1 7.0+PTX 8.9 9.0a", "8.9;9.0a", ["6.0", "6.1", "7.0+PTX"]),
    ("9.0", "9.0", []),
    ("8.0;10.0;12.0+PTX", "8.0;10.0;12.0+PTX", []),
    ("Turing;Ampere;Volta+Tegra;Hopper", "Ampere;Hopper", ["Turing", "Volta+Tegra"]),
    ("7.5", "", ["7.5"]),
    ("native", "native", []),
])
def test_filter_arch_list(arch_list, value, kept, dropped):
    assert arch_list.filter_arch_list(value) == (kept, dropped)


def test_resolve_arch_list(arch_list):
    assert arch_list.resolve_arch_list(None, required=False) == (True, None, "")
    assert arch_list.resolve_arch_list("9.0", required=True) == (True, None, "")
    build, value, note = arch_list.resolve_arch_list("7.0;7.5;8.0;9.0", required=False)
    assert build and value == "8.0;9.0" and "left out 7.0;7.5" in note
    build, value, note = arch_list.resolve_arch_list("7.5", required=False)
    assert not build and value is None and "compress._cuda not built" in note
    with pytest.raises(arch_list.ArchListError, match="names no sm_80 or newer"):
        arch_list.resolve_arch_list("7.5", required=True)
