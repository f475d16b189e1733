"""The CPU a benchmark ran on, as figures are published with it: the model name and the
ISA flags that decide which kernels run (ours and llama.cpp's)."""
from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flags that select kernel paths here or in llama.cpp, in this order
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512vbmi", "gfni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve")


def parse_cpuinfo(text: str) -> dict:
    """``{"model": ..., "family_model": ..., "flags": [...]}`` from the text of
    /proc/cpuinfo (the first processor's): the model name, x86 ``cpu family/model``
    numbers (which tell a generic name such as "AMD EPYC" apart: 25/17 is Zen4 Genoa;
    "" elsewhere), and the ISA flags present in ISA_FLAGS order (x86 ``flags`` or Arm
    ``Features``)."""
    model, family, number, flags = "", "", "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value
        elif key == "cpu family" and not family:
            family = value
        elif key == "model" and not number:
            number = value
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return {"model": model, "family_model": f"{family}/{number}" if family and number else "",
            "flags": [f for f in ISA_FLAGS if f in flags]}


def describe_cpu() -> dict:
    """This machine's CPU: model name, ISA flags and the logical CPU count."""
    import os

    try:
        info = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        info = {"model": "", "family_model": "", "flags": []}
    info["model"] = info["model"] or platform.processor() or platform.machine()
    info["logical_cpus"] = os.cpu_count()
    return info


def cpu_line(cpu: dict) -> str:
    """One line for a benchmark's output:
    ``CPU: <model> (family/model F/M; <flags>), <n> logical CPUs``."""
    fm = f"family/model {cpu['family_model']}; " if cpu.get("family_model") else ""
    return (f"CPU: {cpu['model']} ({fm}{' '.join(cpu['flags']) or 'no listed ISA flags'}), "
            f"{cpu['logical_cpus']} logical CPUs")
