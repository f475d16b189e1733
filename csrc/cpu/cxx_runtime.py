"""Which C++ runtime compress._C links (used by setup.py, loaded by path).

A g++ that has only the static libstdc++ (`-print-file-name=libstdc++.so` finds no file;
one lent GPU machine's /opt/gcc was such a toolchain) links a private copy of the C++
library into the extension, beside the shared one torch loads. Its locale facets then do
not match the streams that c10::str builds, and the first error message that formats a
number (every TORCH_CHECK naming a shape) crashed the process instead of raising. Then the
extension is linked against the libstdc++.so.6 this process has loaded (torch's), so both
use one C++ runtime.
"""
from __future__ import annotations

import os
import subprocess


def libstdcxx_link_args(print_file_name_reply: str, proc_maps: str) -> list[str]:
    """Extra link inputs, from the compiler's reply to `-print-file-name=libstdc++.so` and
    this process's /proc/self/maps: none where the compiler finds a shared libstdc++,
    else the path of the loaded libstdc++.so.6, kept even where the linker runs with
    --as-needed (none where it is not found either)."""
    reply = print_file_name_reply.strip()
    if os.path.isabs(reply) and os.path.exists(reply):
        return []
    for line in proc_maps.splitlines():
        path = line.rsplit(None, 1)[-1] if line.strip() else ""
        if os.path.basename(path).startswith("libstdc++.so.6") and os.path.isabs(path):
            return ["-Wl,--push-state,--no-as-needed", path, "-Wl,--pop-state"]
    return []


def link_args_for(compiler: str) -> list[str]:
    """libstdcxx_link_args for `compiler` in this process (call after importing torch)."""
    try:
        reply = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout
        with open("/proc/self/maps") as f:
            maps = f.read()
    except (OSError, subprocess.SubprocessError):
        return []
    return libstdcxx_link_args(reply, maps)
