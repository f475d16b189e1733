"""Builds a test harness (a C++ / CUDA source driven through ctypes) into a shared
library cached under build/<name>/<hash of its inputs>/, so a suite compiles it once
and again only when a source changes. Written to a temporary name, then renamed: a
failed or interrupted build leaves no library behind."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]


def load_build_module(folder: str, name: str):
    """csrc/<folder>/<name>.py, loaded by path as setup.py loads it (not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "csrc" / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_cached_library(name: str, inputs: list[Path], command: Callable[[Path], list[str]],
                         salt: str = "") -> Path:
    """``command(out)`` is the compiler command that writes the library to ``out``;
    ``inputs`` (and ``salt``, e.g. an include path) decide when to rebuild."""
    h = hashlib.sha256(salt.encode())
    for p in inputs:
        h.update(p.read_bytes())
    out_dir = REPO / "build" / name / h.hexdigest()[:16]
    lib = out_dir / f"lib{name}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"lib{name}.{os.getpid()}.so"
        cmd = command(tmp)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{name} harness build failed:\n{' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
        os.replace(tmp, lib)
    return lib
