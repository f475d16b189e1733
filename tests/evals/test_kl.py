import pytest
import torch

from evals.backend import load_llm
from evals.kl import KLReference, build_kl_reference, kl_per_position, kl_to_reference

from eval_models import make_model_dir


@pytest.fixture(scope="module")
def reference(tiny_llm, tiny_text):
    return build_kl_reference(tiny_llm, tiny_text, windows=3, seq_len=32, progress=False)


@pytest.fixture(scope="module")
def noisy_llm(tmp_path_factory):
    return load_llm(make_model_dir(tmp_path_factory.mktemp("noisy"), noise=0.02))


def test_kl_of_model_to_itself_is_zero(tiny_llm, reference):
    assert reference.input_ids.shape == (3, 32)
    r = kl_to_reference(tiny_llm, reference, progress=False)
    assert r.tokens == 96 and abs(r.kl) < 1e-5 and r.top1_agreement == 1.0


def test_kl_matches_torch_and_grows_with_damage(noisy_llm, reference):
    r = kl_to_reference(noisy_llm, reference, progress=False)
    assert r.kl > 1e-3 and 0 <= r.top1_agreement <= 1
    q = torch.log_softmax(noisy_llm.logits(reference.input_ids).float(), -1)
    expected = torch.nn.functional.kl_div(q, reference.logprobs, log_target=True,
                                          reduction="sum") / reference.tokens
    assert r.kl == pytest.approx(float(expected), rel=1e-4)


def test_topk_is_a_close_lower_bound(tiny_llm, noisy_llm, tiny_text, reference):
    full = kl_to_reference(noisy_llm, reference, progress=False)
    top = build_kl_reference(tiny_llm, tiny_text, windows=3, seq_len=32, top_k=16, progress=False)
    assert top.indices.shape == (3, 32, 16)
    r = kl_to_reference(noisy_llm, top, progress=False)
    assert r.kl <= full.kl + 1e-6 and r.kl > 0.5 * full.kl
    assert r.top1_agreement == full.top1_agreement


def test_kl_per_position_topk_equals_full_when_k_is_vocab():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    q = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    v, i = torch.topk(p, 11)
    assert torch.allclose(kl_per_position(v, q, i), kl_per_position(p, q), atol=1e-5)


def test_reference_save_load(tmp_path, reference, tiny_llm, tiny_text):
    reference.save(tmp_path / "ref.safetensors")
    back = KLReference.load(tmp_path / "ref.safetensors")
    assert torch.equal(back.input_ids, reference.input_ids) and back.indices is None
    top = build_kl_reference(tiny_llm, tiny_text, windows=1, seq_len=32, top_k=4, progress=False)
    top.save(tmp_path / "top.safetensors")
    assert torch.equal(KLReference.load(tmp_path / "top.safetensors").indices, top.indices)


def test_text_shorter_than_a_window_is_an_error(tiny_llm):
    with pytest.raises(ValueError, match="fewer than one window"):
        build_kl_reference(tiny_llm, text="short", seq_len=64, progress=False)
