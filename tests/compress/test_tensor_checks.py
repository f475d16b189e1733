import pytest
import torch

from compress.tensor_checks import all_finite, count_nonfinite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_value_is_caught(dtype, bad):
    t = torch.randn(3, 1000).to(dtype)
    assert all_finite(t) and count_nonfinite(t) == 0
    t[2, 999] = bad
    assert not all_finite(t) and count_nonfinite(t, chunk=7) == 1


def test_integer_and_empty_tensors_are_finite():
    assert all_finite(torch.zeros(0)) and all_finite(torch.ones(4, dtype=torch.int8))
