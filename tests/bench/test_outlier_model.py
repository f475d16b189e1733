"""`compress bench outlier-model`: the copy's residual channels are `--factor` times
larger at the norms' outputs, the consumers compensate, and the model's function is the
same (logits to float rounding)."""
import json

import torch

from compress.cli import main


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_outlier_model_plants_channels_and_keeps_the_function(tiny_llama_dir, tmp_path, one_thread):
    out = tmp_path / "outliers"
    assert main(["bench", "outlier-model", str(tiny_llama_dir), str(out), "--channels", "3",
                 "--down-channels", "2", "--factor", "50", "--seed", "1"]) == 0
    note = (out / "OUTLIERS.md").read_text()
    assert "compress bench outlier-model" in note
    residual = json.loads(note.split("residual channels ")[1].split(", down_proj")[0])
    assert len(residual) == 3

    src, planted = _load(tiny_llama_dir), _load(out)
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        want, got = src(ids).logits, planted(ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-4

    w0 = src.model.layers[0].input_layernorm.weight
    w1 = planted.model.layers[0].input_layernorm.weight
    ratio = w1 / w0
    assert torch.allclose(ratio[residual], torch.full((3,), 50.0))
    others = torch.ones_like(ratio, dtype=torch.bool)
    others[residual] = False
    assert torch.allclose(ratio[others], torch.ones(int(others.sum())))
    # q_proj reads those channels divided by the factor
    q0, q1 = src.model.layers[0].self_attn.q_proj.weight, planted.model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(q1[:, residual] * 50, q0[:, residual], rtol=1e-5, atol=1e-7)
    # a rerun replaces the command's own output
    assert main(["bench", "outlier-model", str(tiny_llama_dir), str(out), "--channels", "1"]) == 0
    assert "--channels 1 " in (out / "OUTLIERS.md").read_text()


def test_outlier_model_names_bad_settings(tiny_llama_dir, tmp_path, capsys, one_thread):
    assert main(["bench", "outlier-model", str(tiny_llama_dir), str(tmp_path / "o"), "--channels", "100000"]) == 2
    assert "--channels 100000" in capsys.readouterr().err
    assert main(["bench", "outlier-model", str(tiny_llama_dir), str(tmp_path / "o"), "--factor", "0"]) == 2
    assert "--factor" in capsys.readouterr().err
    # never replaces a directory it did not write (here the source model itself)
    assert main(["bench", "outlier-model", str(tiny_llama_dir), str(tiny_llama_dir)]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tiny_llama_dir / "config.json").is_file()
