"""Loading holds one copy of the weights: ``LLM(path)`` on a sharded export of over
100 MB, in a fresh process, peaks at no more than 1.3x the loaded model's tensor
bytes above what the process held before loading (torch, transformers and compress
imported). Reading the whole checkpoint and then preparing it held two to three copies."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compress.io.export import export_checkpoint
from compress.io.schemes import QuantizedWeight

pytestmark = [pytest.mark.slow,  # ~10 s each: an export written, a fresh interpreter loading it
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads the process's resident memory from /proc/self/status")]

# one copy of the prepared weights, plus one layer's temporaries, the int8 head's tiling copy
# and 2 MiB rounding of the tensors torch puts in transparent huge pages (compress sets
# THP_MEM_ALLOC_ENABLE); a second copy of the weights would make it 2x. Measured: 1.21x
# (w4a16), 1.12x (dense), 1.05x (the big bf16 head, read into its 2 MiB pages a slice at a
# time; 1.40x when it was read whole, cast, then copied there)
BOUND = 1.3
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Runs in a fresh interpreter: the baseline is its resident memory once everything that
# loading imports is imported; the peak is its high-water mark after LLM(path). VmHWM, not
# getrusage's ru_maxrss: a child started by vfork/exec inherits its parent's high-water
# mark in ru_maxrss (the pytest process's, here), while VmHWM is its own address space's.
MEASURE = r"""
import json, sys
import torch
from transformers import AutoConfig, LlamaConfig  # noqa: F401  (loading imports these)
from compress.runtime import LLM


def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])


def tensor_bytes(model):
    seen = {}
    def add(value):
        if isinstance(value, torch.Tensor):
            seen[(value.data_ptr(), value.nbytes)] = value.nbytes
        elif isinstance(value, (tuple, list)):
            for v in value:
                add(v)
    for module in model.modules():
        for value in [*vars(module).values(), *module._parameters.values(), *module._buffers.values()]:
            add(value)
    return sum(seen.values())


baseline = status_kib("VmRSS")
llm = LLM(sys.argv[1])
peak = status_kib("VmHWM")
print(json.dumps({"baseline": baseline * 1024, "peak": peak * 1024, "model": tensor_bytes(llm.model)}))
"""


def _config(hidden: int, intermediate: int, layers: int, vocab: int):
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
                      max_position_embeddings=256, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _shape(cfg, linear: str) -> tuple[int, int]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}.get(linear, (h, h))


def _random_int4(n: int, k: int, g: torch.Generator, group: int = 128) -> QuantizedWeight:
    return QuantizedWeight("w4a16", {
        "qweight": torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g),
        "scales": torch.rand(n, k // group, generator=g) * 0.01 + 1e-3,
        "zeros": torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=g)},
        {"group_size": group, "in_features": k})


def _export(out: Path, scheme: str) -> Path:
    """A random Llama export in shards of 64 MB: w4a16 linears (~80 MB packed, ~115 MB
    loaded) or dense fp32 (~125 MB); ``w4a16-big-head``: the int4 linears beside a
    bf16-stored head and embedding of a 32,000-token vocabulary (131 MB each in fp32, as
    the runtime holds them: the share a real small model's head has)."""
    g = torch.Generator().manual_seed(0)
    cfg = {"w4a16": _config(1024, 2816, 12, 4096), "dense": _config(512, 1536, 8, 4096),
           "w4a16-big-head": _config(1024, 2816, 12, 32000)}[scheme]
    h, v = cfg.hidden_size, cfg.vocab_size
    stored = torch.bfloat16 if scheme == "w4a16-big-head" else torch.float32
    dense = {"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(stored),
             "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(stored), "model.norm.weight": torch.ones(h)}
    quantized = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        dense[p + "input_layernorm.weight"] = dense[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for linear in LINEARS:
            n, k = _shape(cfg, linear)
            if scheme.startswith("w4a16"):
                quantized[p + linear] = _random_int4(n, k, g)
            else:
                dense[p + linear + ".weight"] = torch.randn(n, k, generator=g) * 0.02
    return export_checkpoint(out, cfg, dense, quantized, max_shard_bytes=64 << 20)


@pytest.mark.parametrize("scheme", ["w4a16", "dense", "w4a16-big-head"])
def test_load_peak_is_one_copy_of_the_weights(tmp_path, scheme):
    path = _export(tmp_path / scheme, scheme)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1  # the sharded path
    run = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["model"] > 100e6  # big enough that a second copy would show
    held = m["peak"] - m["baseline"]
    print(f"{scheme}: held {held / 2**20:.0f} MiB for {m['model'] / 2**20:.0f} MiB of tensors "
          f"({held / m['model']:.3f}x)")
    assert held <= BOUND * m["model"], (
        f"loading held {held / 2**20:.0f} MiB above the {m['baseline'] / 2**20:.0f} MiB baseline for "
        f"{m['model'] / 2**20:.0f} MiB of model tensors ({held / m['model']:.2f}x, bound {BOUND}x)")
