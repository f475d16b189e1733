"""`compress bench kernels`: the M = 1 shapes larger than the last-level cache run at
M = 1 only and are judged against the LLC size the OS reports."""
from __future__ import annotations

import pytest

import compress.ops as ops
from compress.bench import kernels
from compress.bench.bandwidth import last_level_cache_bytes


def _cache_index(root, name, level, size):
    d = root / name
    d.mkdir()
    (d / "level").write_text(f"{level}\n")
    (d / "size").write_text(f"{size}\n")


def test_last_level_cache_is_the_highest_level(tmp_path):
    _cache_index(tmp_path, "index0", 1, "32K")
    _cache_index(tmp_path, "index2", 2, "512K")
    _cache_index(tmp_path, "index3", 3, "32768K")
    assert last_level_cache_bytes(str(tmp_path)) == 32 << 20


def test_last_level_cache_unknown(tmp_path):
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None
    _cache_index(tmp_path, "index0", 1, "garbage")
    assert last_level_cache_bytes(str(tmp_path)) is None


def test_stream_shapes_are_the_70b_mlp_and_exceed_a_32_mib_cache():
    for n, k in kernels.STREAM_SHAPES:
        assert n * k // 2 > 32 << 20  # int4 packed bytes


@pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")
def test_stream_shapes_run_at_m1_only_and_are_summarised(monkeypatch):
    lines = []
    # a 1 KiB "last-level cache": the 32x128 stream shape is larger, 64x256's records too
    monkeypatch.setattr(kernels, "last_level_cache_bytes", lambda: 1024)
    out = kernels.run([(64, 256)], [1, 3], {"compress"}, reps=3, budget_s=1.0, bandwidth_bytes=8 << 20,
                      log=lines.append, stream_shapes=[(32, 128)])
    shapes = {(r["N"], r["K"], r["M"]) for r in out["records"]}
    assert {(32, 128, 1), (64, 256, 1), (64, 256, 3)} <= shapes and (32, 128, 3) not in shapes
    assert out["last_level_cache_bytes"] == 1024
    verdicts = [line for line in lines if "larger than the 0 MiB last-level cache" in line]
    assert len(verdicts) == 2 and "over 6 cases" in verdicts[0]  # w4a16: fp32, bf16, lanes fp32 x 2 shapes
    assert all("target 85%" in v for v in verdicts)


def test_evictor_reads_twice_the_last_level_cache_within_bounds():
    from compress.bench.kernels import EVICT_BYTES, EVICT_MAX_BYTES, evict_bytes
    assert evict_bytes(None) == EVICT_BYTES  # sysfs silent: the default
    assert evict_bytes(32 << 20) == EVICT_BYTES  # a Zen3's 32 MiB L3: the default is larger
    assert evict_bytes(480 << 20) == 960 << 20  # the Xeon VM's reported L3
    assert evict_bytes(64 << 30) == EVICT_MAX_BYTES
