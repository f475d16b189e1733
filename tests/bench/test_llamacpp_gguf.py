"""GGUF files for the llama.cpp baseline: convert (llama.cpp's converter), quantize
(llama-quantize), cache; the bytes a decode step reads. The converter and the quantizer
are small fake executables here (no llama.cpp is built or downloaded)."""
from __future__ import annotations

import os
import stat
import sys

import pytest

from compress.bench import llamacpp_bench
from compress.bench.llamacpp import LlamaCppTools
from compress.bench.llamacpp_bench import (UNKNOWN_PRE_TOKENIZER, LlamaCppRunError, make_gguf, source_key,
                                           streamed_bytes_of)


def _script(path, body: str):
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake_tools(tmp_path):
    """A converter that writes its --outfile (and counts its runs) and a llama-quantize
    that copies its input with the type name appended; a converter that fails with
    ``$FAKE_CONVERTER_ERROR`` when that is set."""
    runs = tmp_path / "converter_runs"
    converter = _script(tmp_path / "convert_hf_to_gguf.py", f"""
import os, sys
open({str(runs)!r}, "a").write(sys.argv[1] + "\\n")
if os.environ.get("FAKE_CONVERTER_ERROR"):
    sys.exit(os.environ["FAKE_CONVERTER_ERROR"])
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "w").write("F16 of " + sys.argv[1])
""")
    quantize = _script(tmp_path / "llama-quantize", f"""#!{sys.executable}
import sys
open(sys.argv[2], "w").write(open(sys.argv[1]).read() + " as " + sys.argv[3] + " on " + sys.argv[4] + " threads")
""")
    tools = LlamaCppTools(version="x", source_dir=str(tmp_path), cmake_args=[], cpu={},
                          tools={"llama-bench": "", "llama-batched-bench": "", "llama-quantize": quantize},
                          converter=converter, gguf_py=str(tmp_path / "gguf-py"))
    return tools, runs


def test_convert_then_quantize_once(fake_tools, tmp_path):
    tools, runs = fake_tools
    hf = tmp_path / "hf"
    hf.mkdir()
    cache = tmp_path / "cache"
    q4 = make_gguf(tools, hf, "q4_0", cache, threads=2, log=lambda *_: None)
    assert q4 == cache / "model-q4_0.gguf"
    assert q4.read_text() == f"F16 of {hf} as Q4_0 on 2 threads"
    q8 = make_gguf(tools, hf, "q8_0", cache, threads=2, log=lambda *_: None)
    assert q8.read_text().endswith("as Q8_0 on 2 threads")
    assert make_gguf(tools, hf, "f16", cache, threads=2) == cache / "model-f16.gguf"
    assert runs.read_text().splitlines() == [str(hf)], "the F16 file is converted once and reused"
    assert sorted(p.name for p in cache.iterdir()) == ["model-f16.gguf", "model-q4_0.gguf", "model-q8_0.gguf"]


def test_a_converter_failure_leaves_no_file_and_names_the_source(fake_tools, tmp_path, monkeypatch):
    tools, _ = fake_tools
    monkeypatch.setenv("FAKE_CONVERTER_ERROR", "KeyError: 'rope_theta'")
    with pytest.raises(LlamaCppRunError, match=r"(?s)convert_hf_to_gguf.py on .*hf failed.*rope_theta"):
        make_gguf(tools, tmp_path / "hf", "q4_0", tmp_path / "cache", threads=1)
    assert not (tmp_path / "cache" / "model-f16.gguf").exists()


def test_a_missing_converter_module_says_what_to_install(fake_tools, tmp_path, monkeypatch):
    tools, _ = fake_tools
    monkeypatch.setenv("FAKE_CONVERTER_ERROR", "ModuleNotFoundError: No module named 'sentencepiece'")
    with pytest.raises(LlamaCppRunError, match=r"needs the Python package 'sentencepiece': pip install sentencepiece"):
        make_gguf(tools, tmp_path / "hf", "f16", tmp_path / "cache", threads=1)


def test_an_unknown_pre_tokenizer_converts_with_a_stand_in(fake_tools, tmp_path, monkeypatch):
    """The embedded model's BPE pre-tokenizer is not in the converter's list: the source
    is converted again from a folder with a stand-in tokenizer.model."""
    tools, runs = fake_tools
    hf, stand_in = tmp_path / "hf", tmp_path / "stand-in"
    hf.mkdir()
    stand_in.mkdir()
    real_convert = llamacpp_bench.convert_to_f16

    def convert(tools_, src, out):
        if src == hf:
            raise LlamaCppRunError(f"NotImplementedError: {UNKNOWN_PRE_TOKENIZER} - update get_vocab_base_pre()")
        real_convert(tools_, src, out)

    monkeypatch.setattr(llamacpp_bench, "convert_to_f16", convert)
    monkeypatch.setattr(llamacpp_bench, "stand_in_tokenizer_dir", lambda src, dest, log: stand_in)
    log = []
    f16 = make_gguf(tools, hf, "f16", tmp_path / "cache", threads=1, log=log.append)
    assert f16.read_text() == f"F16 of {stand_in}"
    assert any("stand-in SentencePiece tokenizer.model" in line for line in log)
    assert runs.read_text().splitlines() == [str(stand_in)]


def test_unknown_gguf_type_is_refused(fake_tools, tmp_path):
    with pytest.raises(ValueError, match=r"unknown GGUF type 'q5_k'"):
        make_gguf(fake_tools[0], tmp_path, "q5_k", tmp_path / "cache", threads=1)


def test_source_key_changes_with_the_checkpoint(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"a")
    k1 = source_key(hf)
    assert k1.startswith("hf-") and source_key(hf) == k1
    (hf / "model.safetensors").write_bytes(b"ab")
    os.utime(hf / "model.safetensors", ns=(1, 1))
    assert source_key(hf) != k1


def test_streamed_bytes_skip_the_embedding_unless_it_is_the_output():
    sizes = {"token_embd.weight": 1000, "output.weight": 700, "blk.0.attn_q.weight": 50, "output_norm.weight": 4,
             "rope_freqs.weight": 8}
    assert streamed_bytes_of(sizes) == 754
    tied = {k: v for k, v in sizes.items() if k != "output.weight"}
    assert streamed_bytes_of(tied) == 1054
