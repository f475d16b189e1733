"""LLM.int8(): outlier detection, mixed-precision decomposition vs plain W8A8, the spike
guard, and calibration on a tiny model with planted outlier features."""
import pytest
import torch

from compress.accuracy import sqnr_db
from compress.architectures import get_arch
from compress.config import ConfigError, from_dict
from compress.ops import reference as ref
from compress.ops.reference import w8a8_outlier_gemm_guarded
from quantizers import primitives
from quantizers.llm_int8 import LLMInt8Config, apply_llm_int8
from quantizers.outliers import column_absmax, find_outlier_columns, quantize_llm_int8
from qhelpers import build_tiny, plant_norm_outliers, rel_err, run_method

PLANTED = [7, 31, 100]


def _layer(tokens=64, k=128, n=96, factor=40.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, PLANTED] *= factor
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x, w


def test_outlier_detection_finds_planted_columns():
    x, _ = _layer()
    idx = find_outlier_columns(column_absmax(x), 6.0)
    assert idx.tolist() == PLANTED and idx.dtype == torch.int64
    with pytest.raises(ValueError, match="threshold"):
        find_outlier_columns(column_absmax(x), 0.0)


def test_decomposition_close_to_float_while_w8a8_is_not():
    x, w = _layer()
    y = x @ w.t()
    qw = quantize_llm_int8(w, find_outlier_columns(column_absmax(x), 6.0), 6.0)
    t = qw.tensors
    assert qw.scheme == "llm_int8" and t["outlier_weight"].shape == (96, 3)
    y_int8 = ref.w8a8_outlier_gemm(x, t["qweight"], t["weight_scale"], t["outlier_idx"], t["outlier_weight"])
    q8, s8 = primitives.quantize_int8_per_channel(w)
    y_w8a8 = ref.w8a8_gemm(x, q8, s8)
    assert sqnr_db(y, y_int8) > 35
    assert sqnr_db(y, y_w8a8) < sqnr_db(y, y_int8) - 10
    # int8 part is the bitsandbytes CB/SCB pair: whole-row scales
    assert torch.equal(t["qweight"], q8) and torch.equal(t["weight_scale"], s8)
    # the state's dequantized weight holds the outlier columns exactly
    assert torch.equal(qw.dequantize()[:, PLANTED], w[:, PLANTED])


def test_spike_outside_static_set_is_caught_by_guard():
    x, w = _layer()
    qw = quantize_llm_int8(w, find_outlier_columns(column_absmax(x), 6.0), 6.0)
    t = qw.tensors
    x_run = x.clone()
    x_run[::4, 50] = 60.0                      # a column never seen as outlier at calibration
    y = x_run @ w.t()
    static = ref.w8a8_outlier_gemm(x_run, t["qweight"], t["weight_scale"], t["outlier_idx"], t["outlier_weight"])
    guarded = w8a8_outlier_gemm_guarded(x_run, t["qweight"], t["weight_scale"], t["outlier_idx"],
                                        t["outlier_weight"], 6.0)
    assert sqnr_db(y, guarded) > sqnr_db(y, static) + 10
    # without a spike the guard computes exactly the static op
    same = w8a8_outlier_gemm_guarded(x, t["qweight"], t["weight_scale"], t["outlier_idx"], t["outlier_weight"], 6.0)
    plain = ref.w8a8_outlier_gemm(x, t["qweight"], t["weight_scale"], t["outlier_idx"], t["outlier_weight"])
    assert torch.equal(same, plain)


def test_calibration_finds_planted_features_in_tiny_model():
    model = build_tiny("llama")
    arch = get_arch("llama")
    plant_norm_outliers(model, arch, PLANTED, 50.0)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    state, ctx = run_method(model, "llama", apply_llm_int8, LLMInt8Config(threshold=6.0), ids)
    assert len(state.quantized) == 14
    for i in range(2):
        for lin in (arch.q_proj, arch.k_proj, arch.v_proj, arch.gate_proj, arch.up_proj):
            qw = state.quantized[f"model.layers.{i}.{lin}"]
            assert qw.scheme == "llm_int8"
            assert set(PLANTED) <= set(qw.tensors["outlier_idx"].tolist())
    stats = ctx.stats["llm_int8"]
    assert 0 < stats["outlier_fraction"] < 0.2
    # outlier columns stored in float16 by default, float32 on request
    assert qw.tensors["outlier_weight"].dtype == torch.float16
    state32, _ = run_method(model, "llama", apply_llm_int8, LLMInt8Config(threshold=6.0, outlier_dtype="float32"), ids)
    assert state32.quantized[f"model.layers.0.{arch.q_proj}"].tensors["outlier_weight"].dtype == torch.float32
    with torch.no_grad():
        assert rel_err(state.model(ids).logits, model(ids).logits) < 0.05


def test_llm_int8_bad_inputs():
    where = "r.yaml: stage 'llm-int8' step 1 (llm_int8)"
    for bad in (0, -1.0):
        with pytest.raises(ConfigError, match=r"llm_int8\)\.threshold: .*must be > 0"):
            from_dict(LLMInt8Config, {"threshold": bad}, where)
    with pytest.raises(ConfigError, match="threshold: expected a number"):
        from_dict(LLMInt8Config, {"threshold": "big"}, where)
    with pytest.raises(ConfigError, match="outlier_dtype"):
        from_dict(LLMInt8Config, {"outlier_dtype": "int4"}, where)
    model = build_tiny("llama")
    ids = torch.randint(0, 512, (2, 16))
    with pytest.raises(ConfigError, match="targets: pattern '\\*o_prj' matches no linear"):
        run_method(model, "llama", apply_llm_int8, LLMInt8Config(targets=["*o_prj"]), ids)
