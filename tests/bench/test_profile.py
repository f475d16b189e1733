"""`compress bench profile` on a tiny model: the one-call decode step is found and timed
(the command wraps the model's DecodePlan, so it must follow the plan's API)."""
import json

import pytest

from compress.cli import main
from compress.ops import native_available


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_profile_times_the_one_call_decode_step(tiny_llama_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "profile.json"
    rc = main(["bench", "profile", str(tiny_llama_dir), "--tokens", "5", "--prompt-len", "4", "--threads", "1",
               "--json", str(out)])
    assert rc == 0
    step = json.loads(out.read_text())["groups"]["whole step (DecodePlan.decode)"]
    assert step["ms_per_token"] > 0 and step["calls_per_token"] == 1
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("whole step (DecodePlan.decode)"))
    assert float(row.split()[-1]) == 1, row


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_profile_per_layer_op_counts_one_call_per_layer(tiny_llama_dir, tmp_path, one_thread):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", str(tiny_llama_dir), "--tokens", "4", "--prompt-len", "4", "--threads", "1",
                 "--per-layer-op", "--json", str(out)]) == 0
    groups = json.loads(out.read_text())["groups"]
    assert groups["whole step (DecodePlan.decode)"]["calls_per_token"] == 0
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    assert groups["whole layers (DecodePlan.step or compress::decode_layer)"]["calls_per_token"] == layers


def test_profile_needs_a_decode_step(tiny_llama_dir, capsys, one_thread):
    assert main(["bench", "profile", str(tiny_llama_dir), "--tokens", "1", "--threads", "1"]) == 2
    assert "--tokens must be at least 2" in capsys.readouterr().err
