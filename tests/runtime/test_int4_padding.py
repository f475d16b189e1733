"""Load-time padding of per-channel int4 weights (``runtime/int4_padding.py``), done on the
packed words: codes below K unchanged, every code from K to the padded K the row's zero
point, whatever the unused nibbles of a partly used last word held."""
from __future__ import annotations

import pytest
import torch

from compress.ops.reference import unpack_int4
from compress.runtime.int4_padding import pad_int4_in_features, padded_in_features


@pytest.mark.parametrize("k", [1, 7, 8, 9, 56, 64, 65, 100, 172, 1000, 1016])
def test_padding_sets_the_zero_point_past_k(k):
    g = torch.Generator().manual_seed(k)
    n = 6
    qweight = torch.randint(-2**31, 2**31 - 1, (n, -(-k // 8)), dtype=torch.int32, generator=g)  # unused nibbles random
    zeros = torch.randint(0, 16, (n, 1), dtype=torch.uint8, generator=g)
    out, group = pad_int4_in_features(qweight, zeros, k, k)
    kp = padded_in_features(k, k, 1)
    assert kp % 64 == 0 and kp - 64 < k <= kp
    if kp == k:
        assert out is qweight and group == k
        return
    assert group == kp and out.dtype == torch.int32 and out.shape == (n, kp // 8) and out.is_contiguous()
    codes = unpack_int4(out)
    assert torch.equal(codes[:, :k], unpack_int4(qweight)[:, :k])
    assert torch.equal(codes[:, k:], zeros.expand(n, kp - k))
    again, group_again = pad_int4_in_features(out, zeros, kp, k)  # idempotent (a fused q/k/v of padded layers)
    assert again is out and group_again == kp


def test_grouped_layers_are_not_padded():
    qweight = torch.zeros(4, 172 // 8 + 1, dtype=torch.int32)
    zeros = torch.full((4, 2), 8, dtype=torch.uint8)
    out, group = pad_int4_in_features(qweight, zeros, 86, 172)
    assert out is qweight and group == 86
