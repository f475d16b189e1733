"""The in-memory hand-off between quantizers and export: one QuantizedWeight per linear.

``tensors`` hold the canonical op layout (``compress/ops/reference.py``) under the
keyword names of the runtime layer class for ``scheme``
(``compress/runtime/layers.py``):

* ``w4a16``: qweight int32 [N, ceil(K/8)], scales [N, K/g], zeros uint8 [N, K/g]; meta: group_size,
  in_features, and ``strategy: channel`` when per channel (g = K, any K; the nibbles past K are 0)
* ``w8a8``: qweight int8 [N, K], weight_scale fp32 [N]
* ``llm_int8``: qweight int8 [N, K], weight_scale fp32 [N], outlier_idx int64 [C], outlier_weight [N, C]; meta: threshold
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCHEMES = ("dense", "w4a16", "w8a8", "llm_int8")


@dataclass
class QuantizedWeight:
    scheme: str
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown weight scheme {self.scheme!r}; known: {SCHEMES}")

    def dequantize(self) -> torch.Tensor:
        """The float32 dense weight this layer computes with (what the runtime runs)."""
        from compress.ops.reference import unpack_int4

        t = self.tensors
        if self.scheme == "w4a16":
            u = unpack_int4(t["qweight"]).to(torch.float32)
            k = int(self.meta.get("in_features", u.shape[1]))
            g = u[:, :k].reshape(u.shape[0], -1, int(self.meta["group_size"]))
            w = (g - t["zeros"].to(torch.float32).unsqueeze(-1)) * t["scales"].to(torch.float32).unsqueeze(-1)
            return w.reshape(u.shape[0], k)
        w = t["qweight"].to(torch.float32) * t["weight_scale"].to(torch.float32).unsqueeze(1)
        if self.scheme == "llm_int8":
            w[:, t["outlier_idx"].long()] = t["outlier_weight"].to(torch.float32)
        return w

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
