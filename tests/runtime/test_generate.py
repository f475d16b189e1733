"""Generation through the LLM facade: paged KV cache vs recompute, batching, stopping,
streaming, cache dtypes, windows, errors."""
from __future__ import annotations

import json

import pytest
import torch

from compress.architectures import UnsupportedArchitectureError
from compress.runtime import LLM, RequestOutput, SamplingParams
from compress.io.checkpoint import CheckpointError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["Hello world", "The quick brown fox jumps over", "def", "A list is a mutable sequence; a tuple"]


def _greedy_recompute(llm: LLM, prompt_ids: list[int], n: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(llm.logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_kv_cache_equals_full_recompute(llm):
    out = llm.generate(PROMPTS[1], GREEDY)[0]
    assert isinstance(out, RequestOutput)
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.token_ids == _greedy_recompute(llm, out.prompt_token_ids, 12)


def test_batched_equals_one_at_a_time(llm):
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in batched] == PROMPTS   # prompt order kept
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate(prompt, GREEDY)[0]
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text


def test_different_max_tokens_in_one_batch(llm):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 1, 6)]
    outs = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 6]
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert out.token_ids == llm.generate(prompt, p)[0].token_ids


def test_token_id_prompts(llm):
    ids = llm.encode(PROMPTS[0])
    assert llm.generate([ids], GREEDY)[0].token_ids == llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    assert llm.generate(ids, GREEDY)[0].prompt_token_ids == ids


def test_stop_strings(llm):
    full = llm.generate(PROMPTS[1], GREEDY)[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_stop_token_ids_and_eos(llm):
    full = llm.generate(PROMPTS[2], GREEDY)[0]
    target = full.token_ids[4]
    first = full.token_ids.index(target)
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target],
                                                 ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    llm.eos_token_ids.add(target)   # the same token as EOS stops too unless ignore_eos
    try:
        eos = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0))[0]
    finally:
        llm.eos_token_ids.discard(target)
    assert eos.finish_reason == "stop" and eos.token_ids == out.token_ids


def test_stream_yields_generate_text(llm):
    for params in (GREEDY, SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)):
        pieces = list(llm.stream(PROMPTS[0], params))
        assert len(pieces) > 1
        assert "".join(pieces) == llm.generate(PROMPTS[0], params)[0].text


def test_stream_with_stop_string_never_leaks_it(llm):
    full = llm.generate(PROMPTS[1], GREEDY)[0].text
    stop = full[3:6]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    assert "".join(llm.stream(PROMPTS[1], params)) == full[:full.index(stop)]


def test_max_seq_len_caps_generation(llama_dir):
    small = LLM(llama_dir, max_seq_len=10)
    ids = small.encode(PROMPTS[0])
    out = small.generate(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(ids) + len(out.token_ids) == 10
    with pytest.raises(ValueError, match="max_seq_len"):
        small.generate("x " * 20, GREEDY)


def test_bad_path(tmp_path):
    with pytest.raises(CheckpointError, match="missing.*does not exist"):
        LLM(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*supports: llama"):
        LLM(tmp_path)


def test_bad_arguments(llama_dir, llm):
    with pytest.raises(ValueError, match="kernels"):
        LLM(llama_dir, kernels="fast")
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_dir, dtype="int3")
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(PROMPTS[:2], [GREEDY])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float32, bfloat16, float16, int8"):
        LLM(llama_dir, kv_cache_dtype=torch.float64)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'int4'"):
        LLM(llama_dir, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "int8"])
def test_half_size_kv_cache_generation(llama_dir, llm, kv):
    """LLM(kv_cache_dtype="float16" / "bfloat16" / "int8") keeps a smaller cache; its
    greedy text starts as the exact cache's does (the rounding of keys and values is
    small) and batching is unchanged."""
    half = LLM(llama_dir, kv_cache_dtype=kv)
    outs = half.generate(PROMPTS[:2], GREEDY)
    assert half.engine.kv_cache.k.dtype == getattr(torch, kv) and llm.kv_cache_dtype == torch.float32
    for prompt, out in zip(PROMPTS[:2], outs):
        assert out.token_ids == half.generate(prompt, GREEDY)[0].token_ids
        assert out.token_ids[:4] == llm.generate(prompt, GREEDY)[0].token_ids[:4]


def test_sliding_window_decode_matches_recompute(tmp_path, tokenizer):
    from runtime_models import save_model
    path, _ = save_model(tmp_path, "mistral", tokenizer, sliding_window=6)
    win = LLM(path)
    assert win.model.layers[0].window == 6
    prompts = [PROMPTS[3], PROMPTS[0]]   # one longer, one shorter than the window
    outs = win.generate(prompts, GREEDY)
    for out in outs:
        assert out.token_ids == _greedy_recompute(win, out.prompt_token_ids, 12)


def test_bf16_generation_batched_equals_single(llama_dir):
    bf = LLM(llama_dir, dtype="bfloat16")
    assert bf.runner.model.dtype == torch.bfloat16
    batched = bf.generate(PROMPTS[:2], GREEDY)
    for prompt, out in zip(PROMPTS[:2], batched):
        assert len(out.token_ids) == 12
        assert out.token_ids[:4] == bf.generate(prompt, GREEDY)[0].token_ids[:4]


def test_runtime_imports_no_compressor_package():
    """The runtime ships without the compressor: no imports of pipeline or algorithms."""
    import ast
    from pathlib import Path

    import compress.runtime
    forbidden = ("compress.pipeline", "compress.recipe", "compress.calibration", "quantizers", "pruning",
                 "distill", "evals")
    for f in Path(compress.runtime.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(forbidden), f"{f.name} imports {name}"


def test_more_prompts_than_max_batch_size(llama_dir, llm):
    small_batches = LLM(llama_dir, max_batch_size=2)
    outs = small_batches.generate(PROMPTS + PROMPTS[:1], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(PROMPTS + PROMPTS[:1], GREEDY)]
    engine = small_batches.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2
        assert engine.stats()["running"] + engine.stats()["waiting"] <= len(PROMPTS)


def test_token_ids_without_tokenizer(llm):
    from compress.io.checkpoint import load_checkpoint
    bare = LLM.from_checkpoint(load_checkpoint(llm.checkpoint_path), tokenizer=None)
    ids = llm.encode(PROMPTS[0])
    out = bare.generate([ids], GREEDY)[0]
    assert out.text == "" and out.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate(PROMPTS[0], GREEDY)


def test_generation_config_sampling_fields_are_the_defaults(tmp_path, llama_dir, llm):
    """A checkpoint whose generation_config.json sets temperature 0 generates greedily when
    no SamplingParams are given (as vLLM's LLM does); explicit params still win."""
    import shutil

    from compress.runtime.engine import sampling_defaults

    assert sampling_defaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                              "do_sample": True}) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                      "repetition_penalty": 1.05}
    assert sampling_defaults({"temperature": -1, "top_p": 0, "top_k": 2.5, "repetition_penalty": "x"}) == {}
    path = tmp_path / "m"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "temperature": 0.0}))
    greedy_default = LLM(path)
    assert greedy_default.default_sampling_fields() == {"temperature": 0.0}
    prompts = [[5, 9, 13], [7, 2, 30, 31]]
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    got = [o.token_ids[:6] for o in greedy_default.generate(prompts)]
    assert got == [w[:len(g)] for w, g in zip(want, got)] and all(got)
    assert llm.default_sampling_fields() == {}
