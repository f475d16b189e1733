"""Prepared weights in 2 MiB pages.

At batch 1 a decode step streams every weight of the model once from DRAM. In 4 KiB
pages that is one TLB miss (a page walk) per 4 KiB and a restart of the hardware
prefetcher at every page boundary: ~45,000 pages per token for a 185 MB model. Linux
backs anonymous memory with 2 MiB pages where the process asks for them
(``madvise(MADV_HUGEPAGE)``, which works under the default ``transparent_hugepage=madvise``),
so after ``prepare()`` the runtime copies the tensors its kernels stream (packed weights,
their scales) into such regions, in the order a decode step reads them. The model builder
moves each layer as soon as it is prepared, into a :class:`HugePageArena`, so loading never
holds the whole model twice.

Where the platform has no ``MADV_HUGEPAGE`` (not Linux) nothing moves. The region is
anonymous memory: pages are only committed as the copies touch them, and it is unmapped
when the last tensor viewing it is freed.
"""
from __future__ import annotations

import math
import mmap
from typing import Iterable

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line
# A HugePageArena's regions: ~0.8% more at most (one partly filled 2 MiB page per region)
REGION_BYTES = 256 << 20


def _aligned(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of ``nbytes`` starting on a 2 MiB boundary, in anonymous memory
    advised for 2 MiB pages; ``None`` where the platform cannot advise that."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # kernel without transparent huge pages
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)  # the views keep `region` mapped
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start:start + nbytes]


def _view(buf: torch.Tensor, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``buf`` from ``offset`` as a ``shape`` tensor of ``dtype``."""
    n = math.prod(shape) * dtype.itemsize
    return buf[offset:offset + n].view(dtype).view(shape)


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor | None:
    """A zero-filled ``shape`` tensor of ``dtype`` in 2 MiB pages (anonymous memory starts
    zeroed and is committed as it is written); ``None`` where the platform cannot advise
    that."""
    buf = huge_page_buffer(math.prod(shape) * dtype.itemsize)
    return None if buf is None else _view(buf, 0, shape, dtype)


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in its own 2 MiB page region, or ``t`` itself where the platform
    cannot advise that."""
    out = huge_page_zeros(t.shape, t.dtype)
    return t if out is None else out.copy_(t)


class HugePageArena:
    """Places tensors back to back (each on a cache line) in regions of 2 MiB pages, in
    the order they come: a region of ``region_bytes`` (address space only: its pages are
    committed as copies touch them) and another when one is full. So a model moved layer
    by layer as it is built lies in a few regions in decode order, and the memory it
    commits beyond its tensors is at most the partly filled last 2 MiB page of each."""

    def __init__(self, region_bytes: int = REGION_BYTES):
        self.region_bytes = region_bytes
        self.moved = 0                  # bytes placed so far (aligned)
        self._buf: torch.Tensor | None = None
        self._offset = 0
        self._unavailable = False       # the platform cannot advise 2 MiB pages
        self._regions: list[int] = []   # the regions' storages' addresses (owns())

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in the arena, or ``t`` itself where the platform cannot advise
        2 MiB pages or ``t`` already lies in the arena (made by :meth:`empty`)."""
        if self.owns(t):
            return t
        view = self.empty(t.shape, t.dtype)
        return t if view is None else view.copy_(t)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """A new ``shape`` tensor of ``dtype`` in the arena, to be filled by the caller (a
        loader that reads a large tensor straight into it, so no second copy is ever
        held); ``None`` where the platform cannot advise 2 MiB pages."""
        n = _aligned(math.prod(shape) * dtype.itemsize)
        if self._buf is None or self._offset + n > self._buf.numel():
            buf = None if self._unavailable else huge_page_buffer(max(n, self.region_bytes))
            if buf is None:
                self._unavailable = True
                return None
            self._buf, self._offset = buf, 0
            self._regions.append(buf.untyped_storage().data_ptr())
        view = _view(self._buf, self._offset, tuple(shape), dtype)
        self._offset += n
        self.moved += n
        return view

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of the arena's regions."""
        return bool(self._regions) and t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._regions


def relocate_to_huge_pages(modules: Iterable, arena: HugePageArena | None = None) -> int:
    """Copies the streamed tensors of ``modules`` (each has ``relocate(place)``, which
    passes every such tensor through ``place`` and keeps what it returns) into 2 MiB
    pages, in module order: into ``arena`` when given, else into one region of exactly
    their size. The old tensors are freed as they move (the modules held the only
    references). Returns the bytes moved (0 when nothing moved)."""
    modules = list(modules)
    if arena is None:
        sizes: list[int] = []

        def measure(t: torch.Tensor) -> torch.Tensor:
            sizes.append(_aligned(t.numel() * t.element_size()))
            return t

        for module in modules:
            module.relocate(measure)
        if not sum(sizes):
            return 0
        arena = HugePageArena(sum(sizes))
    before = arena.moved
    for module in modules:
        module.relocate(arena.place)
    return arena.moved - before
