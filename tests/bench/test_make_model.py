"""`compress bench make-model`: a random-init Llama of the asked shape as a plain HF
directory plus RTN int4 / int8 exports that the runtime loads, with the lm_head in int8
unless asked otherwise."""
import json

import pytest
import torch

from compress.cli import main
from compress.io.inspect import inspect_checkpoint


def test_make_model_writes_the_asked_shape_and_exports(tiny_bench_model):
    cfg = json.loads((tiny_bench_model["hf"] / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (128, 2, 256, 4, 2, 512)
    schemes = {name: {layer: spec["scheme"] for layer, spec in inspect_checkpoint(str(tiny_bench_model[name]))
                      ["layers"].items()} for name in ("rtn-int4", "rtn-int8")}
    assert schemes["rtn-int4"]["lm_head"] == "w8a8" and schemes["rtn-int8"]["lm_head"] == "w8a8"
    assert {s for layer, s in schemes["rtn-int4"].items() if layer != "lm_head"} == {"w4a16"}
    assert {s for layer, s in schemes["rtn-int8"].items() if layer != "lm_head"} == {"w8a8"}
    assert len(schemes["rtn-int4"]) == 2 * 7 + 1  # 7 linears in each of 2 layers, and the head


def test_make_model_exports_follow_the_dense_model(tiny_bench_model):
    """The int8 export's logits stay close to the dense model's (it is the same model)."""
    from transformers import AutoModelForCausalLM

    from compress.runtime import LLM

    ids = torch.arange(5, 37).unsqueeze(0)
    dense = AutoModelForCausalLM.from_pretrained(tiny_bench_model["hf"]).eval()
    with torch.no_grad():
        want = dense(ids).logits.float()
    got = LLM(tiny_bench_model["rtn-int8"], kernels="reference").logits(ids)
    assert ((got - want).norm() / want.norm()) < 0.05


def test_make_model_cli_dense_head_and_tokenizer(tmp_path, repo_root, tiny_bench_shape):
    out = tmp_path / "m"
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in tiny_bench_shape.items()]
    assert main(["bench", "make-model", "--out", str(out), *shape, "--lm-head", "dense", "--no-sentencepiece",
                 "--tokenizer-from", str(repo_root / "models" / "pydoc-llama")]) == 0
    assert (out / "hf" / "tokenizer.json").is_file() and (out / "rtn-int4" / "tokenizer.json").is_file()
    assert "lm_head" not in inspect_checkpoint(str(out / "rtn-int4"))["layers"]
    # a rerun replaces its own output
    assert main(["bench", "make-model", "--out", str(out), *shape, "--no-sentencepiece",
                 "--tokenizer-from", "none"]) == 0
    assert not (out / "hf" / "tokenizer.json").exists()


def test_make_model_refuses_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "m" / "hf").mkdir(parents=True)
    (tmp_path / "m" / "hf" / "notes.txt").write_text("mine")
    assert main(["bench", "make-model", "--out", str(tmp_path / "m"), "--hidden", "128", "--layers", "1",
                 "--intermediate", "256", "--vocab", "64", "--no-sentencepiece", "--tokenizer-from", "none"]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "m" / "hf" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flag,value", [("--tokenizer-from", "/nonexistent/dir")])
def test_make_model_names_a_bad_option(tmp_path, capsys, flag, value):
    assert main(["bench", "make-model", "--out", str(tmp_path / "m"), flag, value]) == 2
    assert flag in capsys.readouterr().err
