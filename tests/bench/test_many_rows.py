"""compress.bench.many_rows, the machinery of the lab csrc/cpu/lab/ab_many_rows.py: a
many-row kernel path (the W8A8 int16 GEMM, the W8A8 and W4A16 AMX tiles) timed against
the tiles it replaces, on single GEMMs and on a packed checkpoint's prefill and decode. On a CPU
without the path both sides run the same tiles; either way the two sides' outputs agree
(the same bits for W8A8, within 40 dB for W4A16 on bf16 tiles) and the path's row
threshold is what it was before."""
import pytest
import torch

from compress import ops
from compress.bench import many_rows

native = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")
PATH_NAMES = sorted(many_rows.PATHS)


@native
@pytest.mark.parametrize("path", PATH_NAMES)
def test_gemm_ab_times_both_sides_and_they_agree(path, one_thread):
    which = many_rows.PATHS[path]
    before = which.get_rows()
    for m, (n, k) in [(3, (40, 128)), (64, (32, 256))]:
        r = many_rows.gemm_ab(path, m, n, k, rounds=1)
        assert set(r.gmacs) == {which.on, which.off, "fp32"} and all(v > 0 for v in r.gmacs.values())
        assert r.comparison.ok, r.comparison.note
        assert (r.comparison.sqnr_db is None) == which.exact
        line = many_rows.format_gemm_ab(path, r)
        assert line.startswith(f"M={m:4d}") and f"{which.on}/{which.off}" in line
    assert which.get_rows() == before


@native
@pytest.mark.parametrize("path,bits", [("int16", 8), ("amx", 8), ("w4-amx", 4), ("w4-panel", 4), ("w4-float-panel", 4)])
def test_prefill_ab_on_a_checkpoint(tiny_bench_model, path, bits, one_thread):
    which = many_rows.PATHS[path]
    before = which.get_rows()
    results = many_rows.prefill_ab(str(tiny_bench_model[f"rtn-int{bits}"]), path, [40, 70], rounds=1)
    assert [r.tokens for r in results] == [40, 70]
    assert all(r.comparison.ok and min(r.tokens_per_s.values()) > 0 for r in results)
    assert which.get_rows() == before


@native
@pytest.mark.parametrize("path,bits", [("amx", 8), ("w4-panel", 4)])
def test_decode_ab_on_a_checkpoint(tiny_bench_model, path, bits, one_thread):
    """Decode steps of 3 and 17 rows (past the AMX tiles' 16, a partial second block) with
    the path on and off: both sides timed, the threshold restored; the W8A8 AMX tiles give
    the VNNI tiles' bits, so greedy tokens agree throughout (the W4A8 panel rounds
    differently: only a share is asked for)."""
    which = many_rows.PATHS[path]
    before = which.get_rows()
    try:
        results = many_rows.decode_ab(str(tiny_bench_model[f"rtn-int{bits}"]), path, [3, 17], rounds=1,
                                      prompt_len=20, new_tokens=5)
    except ValueError as e:  # w4-panel where int4 layers take the lanes layout: nothing to compare
        assert path == "w4-panel" and "lanes layout" in str(e)
        return
    assert [r.rows for r in results] == [3, 17]
    assert all(set(r.tokens_per_s) == {which.on, which.off} and min(r.tokens_per_s.values()) > 0 for r in results)
    assert all(0.0 <= r.same_tokens <= 1.0 for r in results)
    if which.exact:
        assert all(r.same_tokens == 1.0 for r in results)
    assert which.get_rows() == before
    line = many_rows.format_decode_ab(path, results[-1])
    assert line.startswith("decode  17 rows:") and f"{which.on}/{which.off}" in line
    with pytest.raises(ValueError, match="new_tokens >= 2"):
        many_rows.decode_ab(str(tiny_bench_model[f"rtn-int{bits}"]), path, [2], rounds=1, new_tokens=1)


def test_compare_outputs_flags_disagreement():
    a = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert many_rows.compare_outputs(a, a.clone(), exact=True).ok
    differ = many_rows.compare_outputs(a, a + 1e-6, exact=True)
    assert not differ.ok and "DIFFER" in differ.note
    close = many_rows.compare_outputs(a, a * (1 + 1e-4), exact=False)
    assert close.ok and close.sqnr_db > 40
    far = many_rows.compare_outputs(a, a + 0.1 * torch.randn_like(a), exact=False)
    assert not far.ok and "TOO LOW" in far.note
    logits = many_rows.compare_outputs(a, a * (1 + 1e-4), exact=False, what="logits")
    assert logits.ok and "greedy token the same in 4 of 4" in logits.note
