"""Freed heap memory given back to the system while a model loads.

Loading reads, fuses, repacks and moves each layer's tensors in turn, and frees the
intermediates. glibc's malloc serves allocations below its (adaptive, up to 32 MiB)
mmap threshold from its heap and keeps what is freed there for reuse; small tensors the
model keeps (norm weights, biases) sit between the freed blocks, so neither reuse nor
trimming the heap's top gives it back, and the process's resident memory grows by about
a layer's worth of freed intermediates per layer. ``malloc_trim(0)`` returns every whole
free page of the heap to the system. Where the C library has no ``malloc_trim`` (not
glibc) this does nothing.
"""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:  # the process's own symbols, the C library's among them (no library search)
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim(0)``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
