"""The AWQ search's fast paths give what the plain definitions give: the in-place pseudo-
quantization bit for bit, the Gram-matrix clip search and linear loss up to rounding, the
one-forward capture the same inputs as a capture after folding."""
import pytest
import torch

from compress.architectures import get_arch
from compress.calibration import capture_first_block_inputs
from quantizers import primitives
from quantizers.awq import AWQConfig, _linear_loss, _mean_abs, _scale_block, _token_sample
from quantizers.awq_search import activation_scale, group_gram, search_clip
from quantizers.block_capture import capture_inputs
from qhelpers import build_tiny, plant_norm_outliers


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("n,k,group_size", [(300, 512, 128), (7, 256, 32), (5, 172, 172)])
def test_scaled_fake_quantize_is_bit_exact(symmetric, n, k, group_size):
    w = _randn(n, k)
    w[:, 3] *= 20
    s = _randn(k, seed=1).abs() + 0.1
    slow = primitives.fake_quantize_int4(w * s, group_size, symmetric) / s
    fast = primitives.fake_quantize_int4_scaled(w, s, group_size, symmetric, rows=64)
    assert torch.equal(fast, slow)
    assert torch.equal(primitives.fake_quantize_int4_scaled(w, None, group_size, symmetric),
                       primitives.fake_quantize_int4(w, group_size, symmetric))


def _clip_errors(w, x, group_size, ratio):
    """Per (row, group) mean over tokens of (x_g (W_g - Q_r(W_g))^T)^2, directly."""
    n, k = w.shape
    d = (w - primitives.fake_quantize_int4(w, group_size, clip_ratio=ratio)).reshape(n, k // group_size, group_size)
    xg = x.reshape(x.shape[0], k // group_size, group_size)
    return torch.einsum("tgk,ngk->ngt", xg, d).pow(2).mean(dim=-1)


def test_clip_search_picks_the_directly_measured_best_ratio():
    w, x = _randn(40, 256), _randn(300, 256, seed=2)
    w[:, 7] *= 10
    x[:, [3, 90]] *= 15
    ratio = search_clip(w, x, 64, n_grid=10, max_shrink=0.5, row_chunk=16)
    grid = [1 - 0.5 * i / 10 for i in range(10)]
    errs = torch.stack([_clip_errors(w, x, 64, r) for r in grid])          # [ratios, N, G]
    chosen = _clip_errors(w, x, 64, ratio)
    assert torch.allclose(chosen, errs.min(dim=0).values, rtol=1e-5, atol=0)
    assert (ratio < 1).any()


def test_group_gram_gives_the_token_mean_of_squared_products():
    x, d = _randn(100, 64), _randn(64, seed=3)
    gram = group_gram(x, 16)                                              # [4, 16, 16]
    for g in range(4):
        part = d[g * 16:(g + 1) * 16]
        direct = (x[:, g * 16:(g + 1) * 16] @ part).pow(2).mean()
        assert float(part @ gram[g] @ part) == pytest.approx(float(direct), rel=1e-5)


@pytest.mark.parametrize("tokens", [16, 400])      # 16 tokens: direct products; 400: Gram matrix
def test_linear_loss_is_the_output_mean_squared_error(tokens):
    lin = torch.nn.Linear(64, 32)
    xs = [_randn(2, tokens // 2, 64, seed=4)]
    cand = primitives.fake_quantize_int4(lin.weight.data, 16)
    loss = _linear_loss(lin, xs, n_grid=20, quantized=True)([cand])
    expected = (xs[0] @ cand.t() - xs[0] @ lin.weight.data.t()).pow(2).mean()
    assert loss == pytest.approx(float(expected), rel=1e-4)
    assert _linear_loss(lin, xs, n_grid=20, quantized=False)([cand]) == 0.0


def test_token_sample_and_mean_abs_match_the_concatenation():
    xs = [_randn(2, 7, 8), _randn(3, 5, 8, seed=1), _randn(1, 4, 8, seed=2)]
    flat = torch.cat([x.reshape(-1, 8) for x in xs])
    assert torch.equal(_token_sample(xs, 10), flat[torch.linspace(0, flat.shape[0] - 1, 10).long()])
    assert torch.equal(_token_sample(xs, 1000), flat)
    assert torch.allclose(_mean_abs(xs), activation_scale(flat), rtol=1e-6)


def test_clip_inputs_from_one_forward_match_a_capture_after_folding():
    """_scale_block derives the clip search's inputs from what it caught before folding
    (divided by the scales folded into each linear's columns); a real forward of the
    scaled block catches the same."""
    model = build_tiny("llama", num_hidden_layers=1)
    arch = get_arch("llama")
    plant_norm_outliers(model, arch, [5, 40], 20.0)
    block = model.model.layers[0]
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    inputs = capture_first_block_inputs(model, arch, ids, batch_size=2)
    targeted = {n: block.get_submodule(n) for g in arch.scale_groups for n in g.linears}
    clip_names = [n for n in targeted if n not in (arch.q_proj, arch.k_proj)]
    config = AWQConfig(group_size=32, n_grid=5, clip_tokens=40)
    derived = _scale_block(block, inputs, arch, model.config, targeted, config, {}, clip_names)
    after = capture_inputs(block, inputs, {n: targeted[n] for n in clip_names})
    for name in clip_names:
        real = _token_sample(after[name], config.clip_tokens)
        assert derived[name].shape == real.shape == (40, targeted[name].in_features)
        assert float((derived[name] - real).norm() / real.norm()) < 1e-5, name
