"""Export: files, manifest, sharding, tokenizer/recipe, atomic replace, interruption."""
import json

import pytest
import torch

import compress.io.export as export_mod
from compress.io.checkpoint import load_checkpoint
from compress.io.export import ExportError, export_checkpoint, sha256_file
from compress.io.formats import FORMAT_NAME, FORMAT_VERSION
from io_helpers import all_linears, int4_rtn, split_model


def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def _tokenizer_dir(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "tokenizer_config.json").write_text("{}")
    return d


def test_manifest_and_files(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {m: int4_rtn for m in all_linears()[:3]})
    out = export_checkpoint(tmp_path / "m", cfg, dense, q, tokenizer=_tokenizer_dir(tmp_path),
                            recipe_text="steps:\n  - method: rtn\n", extra_manifest={"stage": "int4"},
                            generation_config={"max_new_tokens": 8})
    names = {p.name for p in out.iterdir()}
    assert names == {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "recipe.yaml", "compress_manifest.json"}
    man = json.loads((out / "compress_manifest.json").read_text())
    assert man["format"] == FORMAT_NAME and man["format_version"] == FORMAT_VERSION
    assert man["tool_version"] and man["extra"] == {"stage": "int4"}
    assert set(man["files"]) == names - {"compress_manifest.json"}
    for name, info in man["files"].items():
        assert info["sha256"] == sha256_file(out / name) and info["size"] == (out / name).stat().st_size
    layer = man["layers"]["model.layers.0.self_attn.q_proj"]
    assert layer["scheme"] == "w4a16" and layer["meta"]["group_size"] == 128
    assert "weight_zero_point" in layer["tensors"]
    ck = load_checkpoint(out)
    assert ck.tokenizer_path == out and ck.manifest["extra"]["stage"] == "int4"
    assert ck.size_bytes == (out / "model.safetensors").stat().st_size
    assert all(f["status"] == "ok" for f in ck.files.values())


def test_sharded_export_roundtrip(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {m: int4_rtn for m in all_linears()})
    out = export_checkpoint(tmp_path / "s", cfg, dense, q, max_shard_bytes=300_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    ck = load_checkpoint(out)
    assert set(ck.quantized) == set(q) and set(ck.dense) == set(dense)


def test_interrupted_export_leaves_nothing(tmp_path, tiny_llama, monkeypatch):
    cfg, sd = tiny_llama

    calls = []

    def boom(writer, name, t):
        calls.append(name)
        if len(calls) == 3:                        # some tensors are on disk by now
            raise OSError("disk full (simulated)")
        writer.add(name, t)
    monkeypatch.setattr(export_mod, "_write_tensor", boom)
    with pytest.raises(OSError, match="simulated"):
        export_checkpoint(tmp_path / "x", cfg, sd, {}, recipe_text="r")
    assert not (tmp_path / "x").exists()
    assert _leftovers(tmp_path, "x") == []


def test_interrupted_replace_keeps_previous_export(tmp_path, tiny_llama, monkeypatch):
    cfg, sd = tiny_llama
    out = export_checkpoint(tmp_path / "x", cfg, sd, {}, recipe_text="first\n")
    before = {p.name: sha256_file(p) for p in out.iterdir()}

    def boom(*a, **k):
        raise RuntimeError("tokenizer failed (simulated)")
    monkeypatch.setattr(export_mod, "_save_tokenizer", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        export_checkpoint(tmp_path / "x", cfg, sd, {}, recipe_text="second\n", tokenizer=object())
    assert {p.name: sha256_file(p) for p in out.iterdir()} == before
    assert _leftovers(tmp_path, "x") == []
    load_checkpoint(out)


def test_replace_existing_export(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    export_checkpoint(tmp_path / "x", cfg, sd, {}, recipe_text="first\n")
    dense, q = split_model(sd, {m: int4_rtn for m in all_linears()})
    out = export_checkpoint(tmp_path / "x", cfg, dense, q, recipe_text="second\n")
    assert (out / "recipe.yaml").read_text() == "second\n"
    assert len(load_checkpoint(out).quantized) == len(q)
    assert _leftovers(tmp_path, "x") == []


def test_refuses_to_replace_foreign_directory(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("precious")
    with pytest.raises(ExportError, match="not a compress export"):
        export_checkpoint(tmp_path / "home", cfg, sd, {})
    assert (tmp_path / "home" / "notes.txt").read_text() == "precious"


def test_bad_export_inputs(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {"model.layers.0.mlp.up_proj": int4_rtn})
    dense["model.layers.0.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ExportError, match="both quantized and present as dense"):
        export_checkpoint(tmp_path / "y", cfg, dense, q)
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_modes_follow_the_umask(tmp_path, tiny_llama, umask):
    """Exports are shared and served from other accounts: the directory and its files get
    the modes the umask gives any new file, not tempfile's private 0700 / 0600."""
    import os
    import stat

    cfg, sd = tiny_llama
    dense, q = split_model(sd, {m: int4_rtn for m in all_linears()[:2]})
    old = os.umask(umask)
    try:
        out = export_checkpoint(tmp_path / "m", cfg, dense, q, tokenizer=_tokenizer_dir(tmp_path),
                                recipe_text="steps: []\n")
        again = export_checkpoint(tmp_path / "m", cfg, dense, q)   # replacing an export
    finally:
        os.umask(old)
    assert again == out
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask}


def test_atomic_write_text_mode_follows_the_umask(tmp_path):
    import os
    import stat

    from compress.io.files import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "report.md", "# report\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o644


def test_every_tokenizer_file_of_a_source_dir_is_copied(tmp_path, tiny_llama):
    """A sentencepiece ``tokenizer.model`` beside ``tokenizer.json``, the chat template and
    extra templates travel with the export byte for byte."""
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {m: int4_rtn for m in all_linears()[:2]})
    src = _tokenizer_dir(tmp_path)
    (src / "tokenizer.model").write_bytes(bytes(range(256)) * 4)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (src / "model.safetensors").write_bytes(b"not a tokenizer file")
    out = export_checkpoint(tmp_path / "m", cfg, dense, q, tokenizer=src)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja",
                 "additional_chat_templates/tool_use.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    man = json.loads((out / "compress_manifest.json").read_text())
    assert "additional_chat_templates/tool_use.jinja" in man["files"]
    assert load_checkpoint(out).config  # the manifest's checksums verify
