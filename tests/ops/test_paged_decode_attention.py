"""compress::paged_decode_attention: the reference against a plain per-row computation
on the gathered keys, and every kernel (the native op on each ISA) against the reference
at odd lengths and block boundaries, shuffled block tables, GQA ratios, windows and the
fp32 / bf16 / fp16 cache element types and int8 rows (a scale each, kv_int8.py); opcheck;
errors."""
from __future__ import annotations

import math

import pytest
import torch

from held_thread import run_with_a_held_thread

from compress.ops import kv_int8, reference

BS = 8  # block size of the cases
# context lengths around block boundaries: 1, BS-1, BS, BS+1, 3 BS+5
LENS = [1, BS - 1, BS, BS + 1, 3 * BS + 5]


def paged_case(lens: list[int], hq: int, hkv: int, d: int, q_dtype=torch.float32, kv_dtype=torch.float32,
               block_size: int = BS, spare_blocks: int = 3, seed: int = 0):
    """(q, k_pool, v_pool, block_tables, context_lens) with each row's blocks drawn from a
    shuffled pool (so no row's blocks are in order or adjacent), table entries past a
    row's context set to -1, and a few pool blocks nobody uses."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    m = max(need) + 1  # one column more than any row needs
    nb = sum(need) + spare_blocks
    order = torch.randperm(nb, generator=gen).tolist()
    tables = torch.full((len(lens), m), -1, dtype=torch.int32)
    nxt = 0
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(order[nxt:nxt + n], dtype=torch.int32)
        nxt += n
    k_pool = kv_int8.to_pool(torch.randn(nb, hkv, block_size, d, generator=gen), kv_dtype)
    v_pool = kv_int8.to_pool(torch.randn(nb, hkv, block_size, d, generator=gen), kv_dtype)
    q = torch.randn(len(lens), hq, d, generator=gen).to(q_dtype)
    return q, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32)


def plain_attention(q, k_pool, v_pool, tables, lens, window):
    """Row by row and head by head in float64 on the keys gathered position by position."""
    b, hq, d = q.shape
    hkv, bs = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for r in range(b):
        n = int(lens[r])
        first = max(0, n - window) if window > 0 else 0
        keys = torch.stack([k_pool[int(tables[r, p // bs]), :, p % bs] for p in range(first, n)]).double()
        vals = torch.stack([v_pool[int(tables[r, p // bs]), :, p % bs] for p in range(first, n)]).double()
        for h in range(hq):
            kv = h // (hq // hkv)
            p = torch.softmax(keys[:, kv] @ q[r, h].double() / math.sqrt(d), dim=0)
            out[r, h] = p @ vals[:, kv]
    return out


@pytest.mark.parametrize("window", [0, 1, 5, BS + 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_reference_matches_plain_attention(heads, window):
    q, k, v, tables, lens = paged_case(LENS, *heads, 16)
    got = reference.paged_decode_attention(q, k, v, tables, lens, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), plain_attention(q, k, v, tables, lens, window), rtol=1e-5, atol=1e-5)


def test_reference_window_past_the_context_is_full_attention():
    q, k, v, tables, lens = paged_case(LENS, 4, 2, 16)
    torch.testing.assert_close(reference.paged_decode_attention(q, k, v, tables, lens, 1000),
                               reference.paged_decode_attention(q, k, v, tables, lens, 0))


def test_reference_row_of_length_one_is_its_value():
    q, k, v, tables, lens = paged_case([1], 4, 2, 16)
    got = reference.paged_decode_attention(q, k, v, tables, lens, 0)
    want = v[int(tables[0, 0]), :, 0].repeat_interleave(2, dim=0)
    torch.testing.assert_close(got[0], want)


KV_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
             (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32),
             (torch.float32, torch.int8), (torch.bfloat16, torch.int8)]


@pytest.mark.parametrize("dtypes", KV_DTYPES, ids=lambda t: f"q_{str(t[0])[6:]}-kv_{str(t[1])[6:]}")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("d", [64, 20])
def test_native_matches_reference(isa, dtypes, heads, window, d):
    """head_dim 64 takes the vector paths, 20 (not a multiple of 8) the generic one; the
    forced scalar ISA the generic one too."""
    q_dtype, kv_dtype = dtypes
    q, k, v, tables, lens = paged_case(LENS, *heads, d, q_dtype, kv_dtype)
    got = torch.ops.compress.paged_decode_attention(q, k, v, tables, lens, window)
    want = reference.paged_decode_attention(q, k, v, tables, lens, window)
    assert got.shape == q.shape and got.dtype == q_dtype
    tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_native_long_context_and_one_key_rows(isa):
    """Rows whose lengths differ by two orders of magnitude in one batch (threads split
    over rows and heads), with a row of one key."""
    q, k, v, tables, lens = paged_case([1, 300, 2, 129], 8, 2, 64, block_size=16)
    for window in (0, 7):
        torch.testing.assert_close(torch.ops.compress.paged_decode_attention(q, k, v, tables, lens, window),
                                   reference.paged_decode_attention(q, k, v, tables, lens, window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("window", [0, 6, 40])
def test_native_rows_that_share_their_keys(isa, kv_dtype, window):
    """A prompt chunk run as one-token rows (the same block table, lengths n, n + 1, ..)
    between other rows: the kernel gathers such a group's keys once and gives each row its
    prefix; a row whose table differs in a block it uses, or whose length does not follow,
    is a group of its own. The same outputs as the reference, row by row."""
    base = paged_case([21], 4, 2, 64, kv_dtype=kv_dtype, block_size=BS, spare_blocks=6, seed=3)
    q1, k, v, table, _ = base
    chunk = list(range(14, 22))                         # positions 13..20 of one sequence
    rows_tables = [table[0]] * len(chunk)
    other = table[0].clone()
    other[1] = int(table[0, 2])                         # same as the chunk but one used block
    lens = [5] + chunk + [22 - 1, 9] + [17, 18]          # a lone row, the chunk, a repeat, a short row, a changed table
    tables = torch.stack([table[0]] + rows_tables + [table[0], table[0]] + [other, other])
    q = torch.randn(len(lens), 4, 64, generator=torch.Generator().manual_seed(5))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = torch.ops.compress.paged_decode_attention(q, k, v, tables, lens_t, window)
    want = reference.paged_decode_attention(q, k, v, tables, lens_t, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_opcheck():
    args = paged_case(LENS, 4, 2, 16)
    torch.library.opcheck(torch.ops.compress.paged_decode_attention.default, (*args, 5),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_errors_name_the_problem(impl):
    op = (torch.ops.compress.paged_decode_attention if impl == "native" else reference.paged_decode_attention)
    errors = (RuntimeError, ValueError)
    q, k, v, tables, lens = paged_case([3, 9], 4, 2, 16)
    with pytest.raises(errors, match="Hq % Hkv|head_dim"):
        op(torch.randn(2, 3, 16), k, v, tables, lens, 0)
    with pytest.raises(errors, match="context_lens"):
        op(q, k, v, tables, torch.tensor([0, 9], dtype=torch.int32), 0)
    with pytest.raises(errors, match="context_lens"):
        op(q, k, v, tables, torch.tensor([3, tables.shape[1] * BS + 1], dtype=torch.int32), 0)
    with pytest.raises(errors, match="block table"):
        bad = tables.clone()
        bad[1, 0] = k.shape[0]
        op(q, k, v, bad, lens, 0)
    with pytest.raises(errors, match="window"):
        op(q, k, v, tables, lens, -1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (12, 4), (16, 1), (6, 6)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunk_kernel_matches_reference_and_is_row_invariant(kv_dtype, heads, block_size, head_dim):
    """The AVX-512 kernel for rows that share their keys (a chunk's (row, q head) pairs four
    a pass, each K and V row read once for them; a pass spans rows of different lengths
    where the q-head group is 3, 2 or 1): the reference's outputs, the per-row loops' bits
    (so a position's attention does not depend on how its prompt was chunked), and a row's
    bits do not depend on how many rows share its chunk (21 rows against the first 5)."""
    import compress.ops as ops
    if "avx512_vnni" not in ops.cpu_isas_available():
        pytest.skip("no AVX-512 VNNI on this CPU: the chunk kernel is not taken")
    import compress._C as C
    hq, hkv = heads
    q1, k, v, table, _ = paged_case([70], hq, hkv, head_dim, kv_dtype=kv_dtype, block_size=block_size,
                                    spare_blocks=5, seed=7)
    lens = torch.arange(50, 71, dtype=torch.int32)          # positions 49..69 of one sequence as 21 rows
    tables = table.repeat(len(lens), 1)
    q = torch.randn(len(lens), hq, head_dim, generator=torch.Generator().manual_seed(11))
    before = C.set_paged_group_kernel(True)
    try:
        got = torch.ops.compress.paged_decode_attention(q, k, v, tables, lens, 0)
        first = torch.ops.compress.paged_decode_attention(q[:5], k, v, tables[:5], lens[:5], 0)
        C.set_paged_group_kernel(False)
        loops = torch.ops.compress.paged_decode_attention(q, k, v, tables, lens, 0)
    finally:
        C.set_paged_group_kernel(before)
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, loops)      # the kernel runs the loops' operations per (row, head)
    assert torch.equal(got[:5], first)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads", [(16, 8), (12, 4), (15, 5), (8, 1), (6, 6)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 128), (32, 32), (5, 48)])
@pytest.mark.parametrize("window", [0, 7])
def test_row_kernel_runs_the_loops_operations(kv_dtype, heads, block_size, head_dim, window):
    """The AVX-512 kernel for rows that attend alone (decode rows: keys read in the pool, two
    per zmm, scores folded by the loops' tree, p.V 16 elements a zmm) gives the per-row
    loops' bits, at lengths around its 8-key groups and its prefetch distances, with odd
    q-head groups, blocks that are no multiple of 8 and windows; and the reference's values."""
    import compress.ops as ops
    if "avx512_vnni" not in ops.cpu_isas_available():
        pytest.skip("no AVX-512 VNNI on this CPU: the row kernel is not taken")
    import compress._C as C
    hq, hkv = heads
    lens = [1, 7, 8, 9, 17, 63, 64, 65, 90]
    q, k, v, tables, ctx = paged_case(lens, hq, hkv, head_dim, kv_dtype=kv_dtype, block_size=block_size, seed=3)
    before = C.set_paged_row_kernel(True)
    try:
        got = torch.ops.compress.paged_decode_attention(q, k, v, tables, ctx, window)
        C.set_paged_row_kernel(False)
        loops = torch.ops.compress.paged_decode_attention(q, k, v, tables, ctx, window)
    finally:
        C.set_paged_row_kernel(before)
    assert torch.equal(got, loops)
    want = reference.paged_decode_attention(q, k, v, tables, ctx, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads", [(16, 8), (12, 4), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_a_few_token_chunk_gives_each_row_its_bits_alone(kv_dtype, heads):
    """A chunk of 2..8 rows (a long prompt's few-token chunk beside running decodes) through
    the chunk kernel: each row's output has the bits of that row attending alone (the
    decode rows' kernel) and of the per-row loops, at 131..139 keys (across 8-key groups
    and a block boundary)."""
    import compress.ops as ops
    if "avx512_vnni" not in ops.cpu_isas_available():
        pytest.skip("no AVX-512 VNNI on this CPU: neither kernel is taken")
    import compress._C as C
    hq, hkv = heads
    _, k, v, table, _ = paged_case([140], hq, hkv, 64, kv_dtype=kv_dtype, block_size=16, spare_blocks=3, seed=5)
    op = torch.ops.compress.paged_decode_attention
    try:
        for n in range(2, 9):
            lens = torch.arange(131, 131 + n, dtype=torch.int32)
            tables = table.repeat(n, 1)
            q = torch.randn(n, hq, 64, generator=torch.Generator().manual_seed(n))
            chunk = op(q, k, v, tables, lens, 0)
            alone = torch.cat([op(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], 0) for i in range(n)])
            C.set_paged_group_kernel(False)
            loops = op(q, k, v, tables, lens, 0)
            C.set_paged_group_kernel(True)
            assert torch.equal(chunk, alone) and torch.equal(chunk, loops), n
    finally:
        C.set_paged_group_kernel(True)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
def test_a_thread_held_up_has_its_items_taken_over_with_the_same_bits(kv_dtype):
    """The (rows, kv head) items run in one contiguous part per thread; a thread done with
    its own takes the rest of another's from its end (kernel_common.h:
    parallel_parts_stealing). Decode rows of odd lengths beside a prompt chunk (rows sharing
    their keys), on two threads with the first held 3 ms: items are taken over (counted by
    lanes_tiles_stolen, the counter of every such split) and the output keeps the bits of
    the items handed out one at a time from a counter."""
    import compress._C as C
    lens = [1, 17, 33, 140, 9] + list(range(131, 138))
    q, k, v, tables, _ = paged_case(lens[:5] + [140], 16, 8, 64, kv_dtype=kv_dtype, block_size=16, seed=3)
    tables = torch.cat([tables[:5], tables[5:].repeat(7, 1)])
    lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 16, 64, generator=torch.Generator().manual_seed(4))
    op = torch.ops.compress.paged_decode_attention
    counter, held, stolen = run_with_a_held_thread(lambda: op(q, k, v, tables, lens, 0), C.set_paged_parts_split)
    assert stolen > 0
    assert torch.equal(held, counter)
    torch.testing.assert_close(counter, reference.paged_decode_attention(q, k, v, tables, lens, 0),
                               rtol=1e-4, atol=1e-4)
