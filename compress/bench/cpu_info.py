"""The CPU a benchmark ran on, as figures are published with it: the model name and the
ISA flags that decide which kernels run (ours and llama.cpp's)."""
from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flags that select kernel paths here or in llama.cpp, in this order
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512vbmi", "gfni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve")


def parse_cpuinfo(text: str) -> dict:
    """``{"model": ..., "flags": [ISA flags present, in ISA_FLAGS order]}`` from the text
    of /proc/cpuinfo (x86 ``flags`` or Arm ``Features``; the first processor's)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return {"model": model, "flags": [f for f in ISA_FLAGS if f in flags]}


def describe_cpu() -> dict:
    """This machine's CPU: model name, ISA flags and the logical CPU count."""
    import os

    try:
        info = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        info = {"model": "", "flags": []}
    info["model"] = info["model"] or platform.processor() or platform.machine()
    info["logical_cpus"] = os.cpu_count()
    return info


def cpu_line(cpu: dict) -> str:
    """One line for a benchmark's output: ``CPU: <model> (<flags>), <n> logical CPUs``."""
    return f"CPU: {cpu['model']} ({' '.join(cpu['flags']) or 'no listed ISA flags'}), {cpu['logical_cpus']} logical CPUs"
