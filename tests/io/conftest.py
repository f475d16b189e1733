"""Fixtures for tests/io (helpers live in io_helpers.py)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from io_helpers import tiny_llama_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    cfg = tiny_llama_config()
    model = LlamaForCausalLM(cfg).eval()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return cfg, sd
