"""scripts/profile_decode.py on a tiny model: the one-call decode step is found and
timed (the script wraps the model's DecodePlan, so it must follow the plan's API)."""
import importlib.util

import pytest

from compress.ops import native_available


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_profile_decode_times_the_one_call_step(repo_root, llama_dir, capsys):
    spec = importlib.util.spec_from_file_location("profile_decode", repo_root / "scripts" / "profile_decode.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(llama_dir), "--tokens", "5", "--prompt-len", "4", "--threads", "1"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("whole step (DecodePlan.decode)"))
    ms, share, calls = row.split()[-3:]
    assert float(ms) > 0 and float(calls) == 1, row
