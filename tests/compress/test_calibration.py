"""Calibration data loading and the layer-by-layer block iterator."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.architectures import get_arch
from compress.calibration import CalibrationError, iterate_blocks, load_calibration_ids


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_text_and_jsonl_are_seeded_windows(tmp_path, tok):
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": f"record {i} says hello"}) for i in range(30)))
    a = load_calibration_ids([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tok, 6, 32, seed=1, field="body")
    b = load_calibration_ids([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tok, 6, 32, seed=1, field="body")
    c = load_calibration_ids([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tok, 6, 32, seed=2, field="body")
    assert a.shape == (6, 32) and torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("setup, match", [
    (lambda p: p.write_text("   \n"), "calibration set is empty"),
    (lambda p: p.write_text("tiny"), "fewer than seq_len"),
])
def test_bad_calibration_text(tmp_path, tok, setup, match):
    f = tmp_path / "c.txt"
    setup(f)
    with pytest.raises(CalibrationError, match=match):
        load_calibration_ids([str(f)], tok, 4, 64, 0)


def test_missing_file_and_bad_jsonl(tmp_path, tok):
    with pytest.raises(CalibrationError, match="not found"):
        load_calibration_ids([str(tmp_path / "nope.txt")], tok, 4, 8, 0)
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(CalibrationError, match=r"d.jsonl:2: record has no field 'text'"):
        load_calibration_ids([str(bad)], tok, 4, 8, 0)
    bad.write_text('{"text": "ok"\n')
    with pytest.raises(CalibrationError, match=r"d.jsonl:1: invalid JSON"):
        load_calibration_ids([str(bad)], tok, 4, 8, 0)


def test_iterate_blocks_matches_full_forward_and_sees_changes(tiny_family_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_family_dir).eval()
    arch = get_arch(model.config.model_type)
    ids = torch.randint(0, model.config.vocab_size, (5, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.model(ids, output_hidden_states=True).hidden_states
    seen = []
    for index, block, inputs in iterate_blocks(model, arch, ids, batch_size=2):
        got = torch.cat(inputs.hidden)
        torch.testing.assert_close(got, want[index], rtol=1e-5, atol=1e-5)
        seen.append(index)
    assert seen == list(range(model.config.num_hidden_layers))

    # a change made to block 0 while iterating feeds block 1's inputs
    gen = iterate_blocks(model, arch, ids, batch_size=5)
    _, block0, _ = next(gen)
    with torch.no_grad():
        block0.mlp.down_proj.weight.zero_()
        block0.self_attn.o_proj.weight.zero_()
    _, _, inputs1 = next(gen)
    torch.testing.assert_close(torch.cat(inputs1.hidden), want[0])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sliding_layers_calibrate_with_their_own_mask(tmp_path, family):
    """layer_types mixing full and sliding attention (use_sliding_window with
    max_window_layers): each block runs on the mask the model gives it, so a window shorter
    than the calibration rows changes nothing against the model's own forward."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / family, family, num_hidden_layers=3, use_sliding_window=True,
                           sliding_window=6, max_window_layers=1)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ids = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.model(ids, output_hidden_states=True).hidden_states
    for index, _, inputs in iterate_blocks(model, get_arch(family), ids, batch_size=2):
        torch.testing.assert_close(torch.cat(inputs.hidden), want[index], rtol=1e-5, atol=1e-5)


def test_nan_activations_are_reported(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    arch = get_arch("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    ids = torch.randint(0, 500, (2, 8))
    with pytest.raises(CalibrationError, match=r"output of block 0 \(model.layers.0\)"):
        for _ in iterate_blocks(model, arch, ids):
            pass
