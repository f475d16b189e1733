"""Host tests of the CUDA bindings' argument checks (csrc/cuda/op_checks.h, torch-free, so
the harness calls them directly): every tensor on the first one's device, group sizes,
shapes, dtypes, the int32-accumulation K limit and the paged attention's pools, tables and
window, with messages naming the argument."""
from __future__ import annotations

import ctypes

import pytest
import torch

from cuda_harness import load_harness, ptr as _p


@pytest.fixture(scope="module")
def lib():
    return load_harness()


# --- the bindings' argument checks (op_checks.h) --------------------------------------------
_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.uint8: 3, torch.int8: 4, torch.int16: 5,
         torch.int32: 6, torch.int64: 7, torch.float64: 8}
_OPS = {"w4a16_shuffle_for_cuda": 0, "w4a16_gemm_shuffled": 1, "w4a16_gemm": 2, "quantize_per_token_int8": 3,
        "w8a8_gemm": 4, "w8a8_outlier_gemm": 5, "paged_decode_attention": 6}


def _desc(shape, dtype, device="cuda:0"):
    typ, _, index = device.partition(":")
    numel = 1
    for d in shape:
        numel *= d
    sizes = list(shape) + [0] * (4 - len(shape))
    return [{"cpu": 0, "cuda": 1}.get(typ, 2), int(index) if index else -1, _KIND[dtype], len(shape),
            sizes[0], sizes[1], numel, sizes[2], sizes[3]]


def _check(lib, op, tensors, *ints) -> str:
    flat = torch.tensor([v for t in tensors for v in t] + [0] * 9 * (5 - len(tensors)), dtype=torch.int64)
    iv = torch.tensor(list(ints) + [0, 0], dtype=torch.int64)
    buf = ctypes.create_string_buffer(2048)
    assert lib.cpk_check_op(_OPS[op], _p(flat), _p(iv), buf, 2048) >= 0
    return buf.value.decode()


def _valid(op):
    """A valid argument list of each op: (names, [(shape, dtype)], ints); N=200, K=320, g=32."""
    f16, i32, u8 = torch.float16, torch.int32, torch.uint8
    return {
        "w4a16_shuffle_for_cuda": (["qweight", "scales", "zeros"], [((200, 40), i32), ((200, 10), f16), ((200, 10), u8)],
                                   (32,)),
        "w4a16_gemm_shuffled": (["x", "qweight_shuffled", "scales_t", "zeros_t"],
                                [((5, 320), f16), ((16, 640), i32), ((10, 256), f16), ((10, 256), u8)], (32, 200)),
        "w4a16_gemm": (["x", "qweight", "scales", "zeros"],
                       [((5, 320), f16), ((200, 40), i32), ((200, 10), f16), ((200, 10), u8)], (32,)),
        "quantize_per_token_int8": (["x"], [((5, 320), torch.bfloat16)], ()),
        "w8a8_gemm": (["x", "qweight", "weight_scale"], [((5, 320), f16), ((200, 320), torch.int8), ((200,), torch.float32)],
                      ()),
        "w8a8_outlier_gemm": (["x", "qweight", "weight_scale", "outlier_idx", "outlier_weight"],
                              [((5, 320), f16), ((200, 320), torch.int8), ((200,), torch.float32),
                               ((3,), torch.int64), ((200, 3), f16)], ()),
        "paged_decode_attention": (["q", "k_pool", "v_pool", "block_tables", "context_lens"],
                                   [((3, 8, 64), torch.bfloat16), ((40, 2, 16, 64), f16), ((40, 2, 16, 64), f16),
                                    ((3, 9), i32), ((3,), i32)], (0,)),
    }[op]


@pytest.mark.parametrize("op", list(_OPS))
def test_op_checks_accept_valid_arguments(lib, op):
    _, tensors, ints = _valid(op)
    assert _check(lib, op, [_desc(*t) for t in tensors], *ints) == ""


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
@pytest.mark.parametrize("op", list(_OPS))
def test_op_checks_every_tensor_on_the_first_ones_device(lib, op, device):
    """Scales, zeros, weight_scale, outlier tensors on the CPU or another GPU would hand
    the kernel a pointer into another memory: each one is named and rejected."""
    names, tensors, ints = _valid(op)
    for i, name in enumerate(names):
        descs = [_desc(*t, device=device if j == i else "cuda:0") for j, t in enumerate(tensors)]
        msg = _check(lib, op, descs, *ints)
        if i == 0 and device == "cpu":
            assert msg.startswith(name + " must be a CUDA tensor"), msg
        elif i == 0:  # the others are now off the first one's device
            assert msg == "" if len(names) == 1 else msg.startswith(f"{names[1]} is on cuda:0 but {name} is on {device}")
        else:
            assert msg.startswith(f"{name} is on {device} but {names[0]} is on cuda:0"), msg


@pytest.mark.parametrize("group", [0, -16])
@pytest.mark.parametrize("op", ["w4a16_gemm_shuffled", "w4a16_gemm", "w4a16_shuffle_for_cuda"])
def test_op_checks_reject_a_group_size_that_is_not_positive(lib, op, group):
    names, tensors, ints = _valid(op)
    msg = _check(lib, op, [_desc(*t) for t in tensors], group, *ints[1:])
    assert "group_size must be" in msg and "positive" in msg, msg


def test_op_checks_w4a16_gemm_groups(lib):
    """The fallback takes the zero points in any integer dtype (as the reference and the
    shuffle do), and scales / zeros must be [N, K / group_size]."""
    x, q = _desc((5, 192), torch.float32), _desc((72, 24), torch.int32)
    for zdtype in (torch.uint8, torch.int32, torch.int64):
        for group, xdtype in ((64, torch.float32), (24, torch.float16), (8, torch.bfloat16), (64, torch.float16)):
            g = 192 // group
            assert _check(lib, "w4a16_gemm", [_desc((5, 192), xdtype), q, _desc((72, g), torch.float16),
                                              _desc((72, g), zdtype)], group) == ""
    bad = [(_desc((72, 4), torch.float16), _desc((72, 3), torch.uint8), "scales must be [72, 3]"),
           (_desc((72, 3), torch.float16), _desc((71, 3), torch.uint8), "zeros must be [72, 3]"),
           (_desc((72, 3), torch.float16), _desc((72, 3), torch.float16), "zeros must be an integer dtype"),
           (_desc((72, 3), torch.int32), _desc((72, 3), torch.uint8), "scales must be float16")]
    for scales, zeros, want in bad:
        assert want in _check(lib, "w4a16_gemm", [x, q, scales, zeros], 64)
    assert "does not divide K=192" in _check(lib, "w4a16_gemm", [x, q, _desc((72, 3), torch.float16),
                                                                 _desc((72, 3), torch.uint8)], 80)
    assert "x has K=190" in _check(lib, "w4a16_gemm", [_desc((5, 190), torch.float16), q,
                                                       _desc((72, 3), torch.float16), _desc((72, 3), torch.uint8)], 64)


def test_op_checks_w4a16_shuffled_shapes(lib):
    names, tensors, ints = _valid("w4a16_gemm_shuffled")
    descs = [_desc(*t) for t in tensors]
    assert "qweight_shuffled must be [8, 640]" in _check(lib, "w4a16_gemm_shuffled", descs, 32, 100)  # N pads to 128
    assert "scales_t must be [20, 256]" in _check(lib, "w4a16_gemm_shuffled", descs, 16, 200)
    assert "x must be float16 or bfloat16" in _check(
        lib, "w4a16_gemm_shuffled", [_desc((5, 320), torch.float32)] + descs[1:], 32, 200)
    assert "multiple of 16" in _check(lib, "w4a16_gemm_shuffled", descs, 8, 200)


def test_op_checks_w8a8_limits(lib):
    """K above the int32-exact limit is rejected by name; the outlier tensors are checked."""
    def w8(k, *outliers):
        return [_desc((2, k), torch.float16), _desc((64, k), torch.int8), _desc((64,), torch.float32), *outliers]
    assert _check(lib, "w8a8_gemm", w8(132104)) == ""
    msg = _check(lib, "w8a8_gemm", w8(132112))
    assert "K=132112 is above 132104" in msg and "int32" in msg
    assert "weight_scale must have N=64" in _check(lib, "w8a8_gemm", w8(128)[:2] + [_desc((63,), torch.float32)])
    ok = (_desc((3,), torch.int64), _desc((64, 3), torch.float32))
    assert _check(lib, "w8a8_outlier_gemm", w8(128, *ok)) == ""
    assert _check(lib, "w8a8_outlier_gemm", w8(128, _desc((3,), torch.int32), ok[1])) == ""
    assert "outlier_idx must be int64 or int32" in _check(lib, "w8a8_outlier_gemm",
                                                          w8(128, _desc((3,), torch.float32), ok[1]))
    assert "outlier_idx must be 1-D" in _check(lib, "w8a8_outlier_gemm", w8(128, _desc((3, 1), torch.int64), ok[1]))
    assert "outlier_weight must be [64, 3]" in _check(lib, "w8a8_outlier_gemm",
                                                      w8(128, ok[0], _desc((64, 2), torch.float32)))


def test_op_checks_paged_decode_attention(lib):
    """Pools of one shape and dtype that fit q (head_dim, Hq % Hkv), int32 tables and
    lengths with one row per query row, a window that is not negative, sizes the kernel's
    int indices and grid hold."""
    names, tensors, ints = _valid("paged_decode_attention")

    def check(window=0, **replace):
        descs = [_desc(*replace.get(name, t)) for name, t in zip(names, tensors)]
        return _check(lib, "paged_decode_attention", descs, window)

    f16, i32 = torch.float16, torch.int32
    for q_dtype in (torch.float16, torch.bfloat16, torch.float32):
        for kv_dtype in (torch.float16, torch.bfloat16, torch.float32):
            pool = ((40, 2, 16, 64), kv_dtype)
            assert check(q=((3, 8, 64), q_dtype), k_pool=pool, v_pool=pool) == ""
    for q_dtype in (torch.float16, torch.float32):  # int8 pools: rows of head_dim values + the fp32 scale
        pool = ((40, 2, 16, 68), torch.int8)
        assert check(q=((3, 8, 64), q_dtype), k_pool=pool, v_pool=pool) == ""
    assert ("k_pool must be 4-D [num_blocks, n_kv_heads, block_size, head_dim + 4 = 68], got [40, 2, 16, 64]"
            in check(k_pool=((40, 2, 16, 64), torch.int8), v_pool=((40, 2, 16, 64), torch.int8)))
    assert "v_pool must have k_pool's sizes" in check(k_pool=((40, 2, 16, 68), torch.int8))
    assert "q must be float16" in check(q=((3, 8, 64), torch.int8), k_pool=((40, 2, 16, 68), torch.int8),
                                        v_pool=((40, 2, 16, 68), torch.int8))
    assert check(window=5) == ""
    assert "window must be >= 0" in check(window=-1)
    assert "q must be 3-D" in check(q=((3, 512), f16))
    assert "q must be float16" in check(q=((3, 8, 64), torch.int32))
    assert "k_pool must be 4-D [num_blocks, n_kv_heads, block_size, head_dim = 64], got [40, 2, 16, 32]" in check(
        k_pool=((40, 2, 16, 32), f16))
    assert "v_pool must have k_pool's sizes [40, 2, 16, 64] and dtype float16" in check(v_pool=((41, 2, 16, 64), f16))
    assert "v_pool must have k_pool's sizes" in check(v_pool=((40, 2, 16, 64), torch.float32))
    assert "k_pool must be float16, bfloat16, float32 or int8" in check(k_pool=((40, 2, 16, 64), i32),
                                                                        v_pool=((40, 2, 16, 64), i32))
    assert "not a multiple of the pools' 3 kv heads" in check(k_pool=((40, 3, 16, 64), f16),
                                                              v_pool=((40, 3, 16, 64), f16))
    assert "head_dim 320 is outside 1..256" in check(q=((3, 8, 320), f16), k_pool=((40, 2, 16, 320), f16),
                                                     v_pool=((40, 2, 16, 320), f16))
    assert "block_tables must be int32 [B = 3, M], got int64 [3, 9]" in check(block_tables=((3, 9), torch.int64))
    assert "block_tables must be int32 [B = 3, M]" in check(block_tables=((2, 9), i32))
    assert "context_lens must be int32 [B = 3], got int32 [4]" in check(context_lens=((4,), i32))
    assert "M * block_size must be below 2^30" in check(block_tables=((3, 2 ** 27), i32))
