"""setup.py's choice of C++ runtime for the extensions (csrc/cpu/cxx_runtime.py): a
compiler with only a static libstdc++ gets the shared one torch loaded as a link input, so
the extension does not carry a second C++ library (whose locale facets broke every error
message with a number in it, and crashed on one lent machine)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from native_harness import load_build_module

MAPS = """7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6
7f20-7f30 r-xp 00000000 08:01 13 /opt/env/lib/libstdc++.so.6.0.33
7f40-7f50 rw-p 00000000 00:00 0
"""


@pytest.fixture(scope="module")
def cxx_runtime():
    return load_build_module("cpu", "cxx_runtime")


def test_a_compiler_with_a_shared_libstdcxx_adds_nothing(cxx_runtime, tmp_path):
    lib = tmp_path / "libstdc++.so"
    lib.write_bytes(b"")
    assert cxx_runtime.libstdcxx_link_args(f"{lib}\n", MAPS) == []


def test_a_static_only_compiler_links_the_loaded_libstdcxx(cxx_runtime):
    # -print-file-name answers the bare name when it finds no such file
    assert cxx_runtime.libstdcxx_link_args("libstdc++.so\n", MAPS) == [
        "-Wl,--push-state,--no-as-needed", "/opt/env/lib/libstdc++.so.6.0.33", "-Wl,--pop-state"]
    assert cxx_runtime.libstdcxx_link_args("libstdc++.so\n", MAPS.splitlines()[0]) == []


def test_the_built_extension_needs_the_shared_libstdcxx():
    import compress.ops as ops
    if not ops.native_available("cpu") or shutil.which("readelf") is None:
        pytest.skip("compress._C not built, or no readelf")
    import compress._C as native
    dynamic = subprocess.run(["readelf", "-d", native.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so.6]" in dynamic
