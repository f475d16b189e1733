"""`compress bench profile` on a tiny model: the engine's one-call native decode step is
found and timed (the command wraps it, so it must follow its API), and the module path
splits a step by op."""
import importlib.util
import json

import pytest

from compress.cli import main
from compress.ops import native_available

has_native_step = native_available("cpu") and importlib.util.find_spec("compress.runtime.native_decode") is not None


@pytest.mark.skipif(not has_native_step, reason="native CPU kernels or the native decode step not built")
def test_profile_times_the_one_call_decode_step(tiny_llama_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "profile.json"
    rc = main(["bench", "profile", str(tiny_llama_dir), "--tokens", "5", "--prompt-len", "4", "--threads", "1",
               "--json", str(out)])
    assert rc == 0
    step = json.loads(out.read_text())["groups"]["whole step (NativeDecode.decode)"]
    assert step["ms_per_step"] > 0 and step["calls_per_step"] == 1
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("whole step (NativeDecode.decode)"))
    assert float(row.split()[-1]) == 1, row


def test_profile_module_path_makes_one_attention_call_per_layer(tiny_llama_dir, tmp_path, one_thread):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", str(tiny_llama_dir), "--tokens", "4", "--prompt-len", "4", "--threads", "1",
                 "--module-path", "--json", str(out)]) == 0
    groups = json.loads(out.read_text())["groups"]
    assert groups["whole step (NativeDecode.decode)"]["calls_per_step"] == 0
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    assert groups["attention"]["calls_per_step"] == layers
    assert groups["norms (compress::rms_norm, add_rms_norm)"]["calls_per_step"] == 2 * layers + 1


def test_profile_rows_decode_together_in_one_step_per_token(tiny_llama_dir, tmp_path, one_thread):
    """--rows 3: the three prompts decode in the same steps (one attention call per layer
    a step, not three), and the settings reach the file."""
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", str(tiny_llama_dir), "--tokens", "4", "--prompt-len", "4", "--threads", "1",
                 "--module-path", "--rows", "3", "--kv-cache-dtype", "float16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    assert result["rows"] == 3 and result["kv_cache_dtype"] == "float16"
    assert result["groups"]["attention"]["calls_per_step"] == layers
    assert result["decode_steps"] == 3


def test_profile_needs_a_decode_step(tiny_llama_dir, capsys, one_thread):
    assert main(["bench", "profile", str(tiny_llama_dir), "--tokens", "1", "--threads", "1"]) == 2
    assert "--tokens must be at least 2" in capsys.readouterr().err
    assert main(["bench", "profile", str(tiny_llama_dir), "--rows", "0", "--threads", "1"]) == 2
    assert "--rows must be at least 1" in capsys.readouterr().err


def test_host_profile_times_every_path_without_the_forward(tiny_llama_dir, tmp_path, capsys, one_thread):
    """`--host`: a step's time less its forward, per path and batch; the forward calls are
    timed inside the step, so the host's part is positive and below the whole step, and
    cProfile's list (the profiler paused in the forward) names the engine's functions."""
    out = tmp_path / "host.json"
    assert main(["bench", "profile", str(tiny_llama_dir), "--host", "--threads", "1", "--batch", "1", "3",
                 "--new-tokens", "4", "--prompt-len", "4", "--rounds", "1", "--cprofile", "30",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["host"]
    paths = ["graphs", "module"] + (["native"] if has_native_step else [])
    assert sorted((r["path"], r["batch"]) for r in rows) == sorted((p, b) for p in paths for b in (1, 3))
    for r in rows:
        assert 0 < r["host_us"] < r["step_us"] and r["steps"] == 3
        names = [f["function"] for f in r["cprofile"]]
        assert any("llm_engine.py" in n for n in names)
        assert not any("models/llama.py" in n for n in names), names   # the forward is left out
    assert "host us/row" in capsys.readouterr().out
