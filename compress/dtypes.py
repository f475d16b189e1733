"""The one table of float dtypes by name, as recipes, CLI flags and runtime arguments
spell them. A leaf module: the runtime imports it without the compressor."""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the runtime's KV cache element types by name (int8: a scale a row, compress/ops/kv_int8.py)
KV_CACHE_DTYPES: dict[str, torch.dtype] = {**DTYPES, "int8": torch.int8}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as a torch dtype; a name outside :data:`DTYPES` is a ValueError naming them."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unknown dtype {dtype}; choose one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")
    return DTYPES[dtype]
