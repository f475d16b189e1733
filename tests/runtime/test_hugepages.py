"""Prepared weights and the KV cache in 2 MiB pages (``compress/runtime/hugepages.py``):
the region is advised for huge pages, relocation keeps every value, layout and output,
and where the platform cannot advise it nothing moves."""
from __future__ import annotations

import mmap

import pytest
import torch

from compress.ops import native_available
from compress.runtime import hugepages
from compress.runtime.hugepages import (HUGE_PAGE, HugePageArena, huge_page_buffer, huge_page_copy,
                                        relocate_to_huge_pages)
from compress.runtime.kv_cache import PagedKVCache
from compress.runtime.layers import LINEAR_TYPES, DenseLinear, Int4Linear, Int8Linear, Int8OutlierLinear
from compress.runtime.models.llama import build_model

from compress.runtime.loading import open_checkpoint
from paged_steps import step_logits
from runtime_models import save_model
from scheme_checkpoints import checkpoint

linux_only = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="needs madvise(MADV_HUGEPAGE) and /proc/self/smaps (Linux)")


def advised_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether ``t``'s first byte lies in a mapping with the ``hg`` (MADV_HUGEPAGE) flag."""
    addr = t.data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= addr < hi:
                flags = next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
                return " hg" in flags
    raise AssertionError(f"address {addr:#x} is in no mapping")


@linux_only
def test_buffer_is_aligned_zeroed_and_advised():
    buf = huge_page_buffer(3 * HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 123
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    buf[-5:] = 7
    assert buf[-5:].tolist() == [7] * 5
    assert advised_for_huge_pages(buf)


def test_no_madvise_means_no_buffer(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    assert huge_page_buffer(HUGE_PAGE) is None
    t = torch.arange(6.0).view(2, 3).t()
    assert huge_page_copy(t) is t


@linux_only
def test_copy_keeps_values_dtype_and_shape():
    t = torch.arange(12, dtype=torch.int16).view(3, 4).t()  # not contiguous
    c = huge_page_copy(t)
    assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
    assert c.data_ptr() % HUGE_PAGE == 0 and advised_for_huge_pages(c)


def _linears():
    g = torch.Generator().manual_seed(0)
    n, k = 48, 256
    w4 = Int4Linear(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g),
                    torch.rand(n, k // 64, generator=g) * 0.1, torch.randint(0, 16, (n, k // 64), generator=g).to(torch.uint8),
                    64, k)
    w8 = Int8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) * 0.01)
    out = Int8OutlierLinear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                            torch.rand(n, generator=g) * 0.01, torch.tensor([3, 100]), torch.randn(n, 2, generator=g))
    dense = DenseLinear(torch.randn(n, k, generator=g))
    for layer in (w4, w8, out, dense):
        layer.prepare("native")
    return [w4, w8, out, dense]


def _streamed(layer) -> list[torch.Tensor]:
    seen = []
    layer.relocate(lambda t: seen.append(t) or t)
    return seen


@linux_only
def test_relocation_keeps_values_and_outputs_and_packs_in_order():
    layers = _linears()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    before = [layer(x) for layer in layers]
    values = [[t.clone() for t in _streamed(layer)] for layer in layers]
    moved = relocate_to_huge_pages(layers)
    assert moved == sum(-(-t.numel() * t.element_size() // 64) * 64 for v in values for t in v)
    after = [_streamed(layer) for layer in layers]
    ptrs = [t.data_ptr() for tensors in after for t in tensors]
    assert ptrs == sorted(ptrs) and ptrs[0] % HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < moved  # one region
    for old, new in zip(values, after):
        for a, b in zip(old, new):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert all(advised_for_huge_pages(t) for tensors in after for t in tensors)
    # the row-tiled layout's scales are the checkpoint's own fp32 tensor: one copy, not two
    # (the lanes layout keeps its own [tiles, K/G, 16] metadata beside the canonical tensors)
    w4 = layers[0]
    if w4.lanes_scales is None:
        assert w4.scales.data_ptr() == w4.cpu_scales[0].data_ptr()
    for layer, y in zip(layers, before):
        assert torch.equal(layer(x), y)


def test_relocation_without_huge_pages_moves_nothing(monkeypatch):
    monkeypatch.setattr(hugepages, "huge_page_buffer", lambda n: None)
    layers = _linears()
    ptrs = [t.data_ptr() for layer in layers for t in _streamed(layer)]
    assert relocate_to_huge_pages(layers) == 0
    assert [t.data_ptr() for layer in layers for t in _streamed(layer)] == ptrs


@linux_only
def test_arena_places_back_to_back_and_opens_a_region_when_full():
    region = 3 * HUGE_PAGE
    arena = HugePageArena(region)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(-100, 100, (n,), dtype=dtype, generator=g)
               for n, dtype in [(1000, torch.int32), (5, torch.int8), (0, torch.int32),
                                (HUGE_PAGE // 2, torch.int32), (HUGE_PAGE, torch.int16)]]
    placed = [arena.place(t) for t in sources]
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in sources]
    for src, new in zip(sources, placed):
        assert new.dtype == src.dtype and new.shape == src.shape and torch.equal(new, src)
    first = placed[0].data_ptr()
    assert first % HUGE_PAGE == 0 and advised_for_huge_pages(placed[0])
    # back to back, each on a cache line, while they fit the region (4 MiB + 4 KiB of 6 MiB) ...
    for i in (1, 3):
        assert placed[i].data_ptr() == first + sum(sizes[:i])
    # ... then a new region for the 4 MiB that would not fit
    last = placed[4].data_ptr()
    assert not first <= last < first + region and last % HUGE_PAGE == 0 and advised_for_huge_pages(placed[4])
    assert arena.moved == sum(sizes)


@linux_only
def test_a_tensor_made_in_the_arena_is_not_moved_again():
    """``empty`` gives a tensor in the arena for a loader to fill (a big head read straight
    there); placing it again returns it as it is, and a tensor from elsewhere is copied."""
    arena = HugePageArena(4 * HUGE_PAGE)
    made = arena.empty((300, 7), torch.float32)
    made.copy_(torch.arange(2100, dtype=torch.float32).view(300, 7))
    moved = arena.moved
    assert arena.owns(made) and arena.place(made) is made and arena.moved == moved
    other = torch.ones(5, 5)
    copy = arena.place(other)
    assert not arena.owns(other) and arena.owns(copy) and copy.data_ptr() != other.data_ptr()
    assert torch.equal(copy, other) and arena.moved > moved


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@linux_only
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "dense"])
def test_model_in_huge_pages_decodes_the_same(tokenizer, scheme, monkeypatch):
    import compress.runtime.models.llama as llama_module

    relocated = []
    real_relocate = llama_module.relocate_to_huge_pages
    monkeypatch.setattr(llama_module, "relocate_to_huge_pages",
                        lambda modules, arena=None: relocated.append(arena) or real_relocate(modules, arena))
    plain_model = build_model(checkpoint("llama", scheme, len(tokenizer)), huge_pages=False)
    # huge_pages=False moves nothing. (Where the plain tensors live cannot tell: with
    # THP_MEM_ALLOC_ENABLE torch's allocator advises its large blocks, and glibc can hand a
    # freed advised block back for small tensors, so their mapping may carry the flag too.)
    assert relocated == []
    models = {False: plain_model,
              True: build_model(checkpoint("llama", scheme, len(tokenizer)), huge_pages=True)}
    assert relocated and all(a is relocated[0] for a in relocated)
    linears = [m for m in models[True].modules() if isinstance(m, LINEAR_TYPES)]
    assert all(advised_for_huge_pages(t) for layer in linears for t in _streamed(layer))
    # moved layer by layer as built, into one arena: in the order a decode step reads them
    ptrs = [t.data_ptr() for layer in linears for t in _streamed(layer)]
    assert ptrs == sorted(ptrs)
    logits = {hp: step_logits(model, [[5, 9, 13, 21, 8, 40, 3]], 4) for hp, model in models.items()}
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)


@linux_only
def test_kv_cache_on_cpu_is_zeroed_huge_page_memory():
    cache = PagedKVCache(3, 40, 2, 16, 8, torch.float16)
    assert cache.k.shape == (3, 40, 2, 16, 8) and cache.k.dtype == torch.float16
    assert int(cache.k.count_nonzero()) == 0 and int(cache.v.count_nonzero()) == 0
    assert advised_for_huge_pages(cache.k) and advised_for_huge_pages(cache.v)
    cache.k[2, 7] = 2.0
    assert torch.equal(cache.layer(2)[0][7], torch.full((2, 16, 8), 2.0, dtype=torch.float16))



@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@linux_only
def test_tied_embedding_is_the_moved_head(tmp_path, tokenizer):
    """With tied embeddings the embedding and the head are one tensor, in 2 MiB pages
    (not the checkpoint's copy beside the moved one)."""
    path, hf = save_model(tmp_path, "llama", tokenizer, tie_word_embeddings=True)
    model = build_model(open_checkpoint(path))
    assert model.embed.data_ptr() == model.lm_head.weight.data_ptr() and advised_for_huge_pages(model.embed)
    ids = torch.tensor([[5, 9, 13, 21]])
    with torch.no_grad():
        want = hf(ids).logits
        got = model.logits(model(ids, torch.arange(4).unsqueeze(0)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@linux_only
@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("tied", [False, True])
def test_only_the_head_is_read_straight_into_the_arena(tmp_path, tokenizer, monkeypatch, tied):
    """The head (or the tied embedding that is the head) is read into the arena a slice at a
    time; the projections are not (q/k/v and gate/up fusing copies them again, and a copy
    already in the arena would stay there unused). Small tensors qualify here too."""
    from compress.runtime.models import llama

    monkeypatch.setattr(llama, "ARENA_DIRECT_BYTES", 0)
    direct = []
    real = llama.CheckpointTensors.dense_in_arena
    monkeypatch.setattr(llama.CheckpointTensors, "dense_in_arena",
                        lambda self, name: direct.append(name) or real(self, name))
    path, hf = save_model(tmp_path, "llama", tokenizer, tie_word_embeddings=tied)
    model = build_model(open_checkpoint(path))
    assert direct == ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    ids = torch.tensor([[5, 9, 13, 21]])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(model(ids, torch.arange(4).unsqueeze(0))), hf(ids).logits,
                                   atol=1e-4, rtol=1e-4)
