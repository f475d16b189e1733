"""TORCH_CUDA_ARCH_LIST filtering for the CUDA build (setup.py): the kernels use cp.async,
ldmatrix and bf16 / int8 mma.sync, which need sm_80 or newer, so a list that also names
older GPUs (common in GPU containers: "7.0;7.5;8.0;8.6;9.0") would fail to compile. Older
entries are left out; the rest is passed on as torch's cpp_extension reads it.

Plain Python with no imports of the package: setup.py loads this file by path."""
from __future__ import annotations

import re

MIN_MAJOR = 8
# torch's named architectures (torch.utils.cpp_extension) that are all older than sm_80
PRE_SM80_NAMES = ("Kepler", "Maxwell", "Pascal", "Volta", "Turing")


def is_pre_sm80(entry: str) -> bool:
    """'7.5', '7.0+PTX', 'Turing', 'Volta+Tegra' -> True; '8.0', '9.0a', '12.0+PTX', 'Hopper',
    'native' -> False (an entry this does not know is left for torch to judge)."""
    if m := re.match(r"(\d+)\.\d+", entry):
        return int(m.group(1)) < MIN_MAJOR
    return entry.split("+")[0] in PRE_SM80_NAMES


def filter_arch_list(value: str) -> tuple[str, list[str]]:
    """(the list without pre-sm_80 entries, as TORCH_CUDA_ARCH_LIST text; the entries
    left out). Entries are separated by ';' or spaces, as torch accepts them."""
    entries = [e for e in value.replace(" ", ";").split(";") if e]
    kept = [e for e in entries if not is_pre_sm80(e)]
    return ";".join(kept), [e for e in entries if is_pre_sm80(e)]


class ArchListError(RuntimeError):
    """TORCH_CUDA_ARCH_LIST names no architecture the CUDA kernels can be built for."""


def resolve_arch_list(value: str | None, required: bool) -> tuple[bool, str | None, str]:
    """What setup.py does with TORCH_CUDA_ARCH_LIST = ``value`` (None: unset): (build
    compress._cuda?, the value to set (None: leave it as it is), a note for the build log
    ('' for none). ``required`` (COMPRESS_BUILD_CUDA=1): nothing left to build for is an
    error rather than a skipped extension."""
    if not value:
        return True, None, ""
    kept, dropped = filter_arch_list(value)
    if not dropped:
        return True, None, ""
    if not kept:
        why = f"TORCH_CUDA_ARCH_LIST={value!r} names no sm_80 or newer architecture (the CUDA kernels need one)"
        if required:
            raise ArchListError(why + "; add one, e.g. 8.0 or 9.0")
        return False, None, f"compress: {why}: compress._cuda not built"
    return True, kept, (f"compress: TORCH_CUDA_ARCH_LIST: left out {';'.join(dropped)} (the CUDA kernels need "
                        f"sm_80 or newer); building for {kept}")
