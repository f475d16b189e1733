"""A small run of the soak script (compress/serve/soak.py): short requests over loopback,
some clients reset mid-stream; no request fails, every KV block is free once the queue
has drained, the server's RSS does not grow after the first quarter, SIGTERM exits 0."""
import pytest

from conftest import EMBEDDED


@pytest.mark.slow
def test_soak_frees_everything():
    from compress.serve.soak import soak

    report = soak(str(EMBEDDED), requests=120, concurrency=8, kill_every=4, max_tokens=16, deadline_s=300)
    assert report["failed"] == 0, report["failures"]
    assert report["killed"] >= 5
    assert report["checkpoints"][-1]["server_saw_disconnects"] >= 5
    assert all(c["kv_blocks_used"] == 0 for c in report["checkpoints"])
    assert report["rss_growth_after_first_quarter_mb"] < 16, report["checkpoints"]
    assert report["server_exit_code"] == 0, report["server_log_tail"]
