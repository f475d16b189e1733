"""Our safetensors reader and streaming shard writer: the reference library reads what
we write, we read what it writes, and broken shard sets are named."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.io.safetensors_files import (SAFE_INDEX_NAME, SafetensorsError, SafetensorsFile, ShardedWriter,
                                           TensorStore)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(33, 17, generator=g), "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
            "c.qweight": torch.randint(-2**31, 2**31 - 1, (8, 3), dtype=torch.int32, generator=g),
            "d.zeros": torch.randint(0, 16, (4, 2), dtype=torch.uint8, generator=g),
            "e.half": torch.randn(3, 4, generator=g).half(), "f.empty": torch.zeros(0, 4)}


def test_written_shards_load_with_the_reference_library(tmp_path):
    ref = _tensors()
    w = ShardedWriter(tmp_path, max_shard_bytes=1000, reserved_header=64)   # tiny header room: the grow path too
    for k, v in ref.items():
        w.add(k, v)
    files = w.finish()
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and files[-1] == SAFE_INDEX_NAME
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / SAFE_INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    got = {}
    for f in shards:
        got.update(load_file(tmp_path / f))
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    assert not list(tmp_path.glob(".shard-*"))          # no temporary part left


def test_reader_reads_reference_files_and_one_shard_is_model_safetensors(tmp_path):
    ref = _tensors()
    save_file(ref, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for k in ref:
        assert torch.equal(f.read(k), ref[k]), k
    w = ShardedWriter(tmp_path / "one", max_shard_bytes=1 << 30) if (tmp_path / "one").mkdir() is None else None
    for k, v in ref.items():
        w.add(k, v)
    assert w.finish() == ["model.safetensors"]
    store = TensorStore(tmp_path / "one")
    assert sorted(store.names()) == sorted(ref) and torch.equal(store.read("b.bias"), ref["b.bias"])


def _sharded(tmp_path):
    w = ShardedWriter(tmp_path, max_shard_bytes=1000)
    for k, v in _tensors().items():
        w.add(k, v)
    return [f for f in w.finish() if f.endswith(".safetensors")]


def test_missing_shard_is_named(tmp_path):
    shards = _sharded(tmp_path)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(SafetensorsError, match=f"lists shard {shards[1]}, which is missing"):
        TensorStore(tmp_path)


def test_truncated_shard_is_named(tmp_path):
    shards = _sharded(tmp_path)
    p = tmp_path / shards[0]
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(SafetensorsError, match=f"{shards[0]}: truncated"):
        TensorStore(tmp_path)
    p.write_bytes(b"\x10\x00")
    with pytest.raises(SafetensorsError, match=f"{shards[0]}: truncated"):
        TensorStore(tmp_path)


def test_index_disagreeing_with_the_shards_is_an_error(tmp_path):
    shards = _sharded(tmp_path)
    index_path = tmp_path / SAFE_INDEX_NAME
    index = json.loads(index_path.read_text())
    name = next(k for k, f in index["weight_map"].items() if f == shards[1])
    index["weight_map"][name] = shards[0]                      # points at the wrong shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match=f"puts tensor '{name}' in {shards[0]}, but it is in {shards[1]}"):
        TensorStore(tmp_path)
    del index["weight_map"][name]                              # a tensor the index does not list
    index_path.write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match=f"does not list tensor '{name}'"):
        TensorStore(tmp_path)
    index["weight_map"][name] = shards[1]
    index["weight_map"]["ghost.weight"] = shards[0]            # a tensor no shard holds
    index_path.write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="'ghost.weight' in .*no shard holds it"):
        TensorStore(tmp_path)


def test_duplicate_tensor_is_refused(tmp_path):
    w = ShardedWriter(tmp_path, max_shard_bytes=1000)
    w.add("x", torch.zeros(2))
    with pytest.raises(SafetensorsError, match="'x' written twice"):
        w.add("x", torch.zeros(2))


def test_rows_of_a_tensor_read_alone(tmp_path):
    """A slice of rows, read without the rest (a loader casting a large tensor a slice at a
    time), is those rows; a range past the tensor is named."""
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert torch.equal(f.read_rows("a.weight", 5, 19), tensors["a.weight"][5:19])
    assert torch.equal(f.read_rows("e.half", 2, 3), tensors["e.half"][2:3])
    assert f.read_rows("a.weight", 7, 7).shape == (0, 17)
    assert torch.equal(f.read("b.bias"), tensors["b.bias"])
    with pytest.raises(SafetensorsError, match=r"no rows \[30, 40\)"):
        f.read_rows("a.weight", 30, 40)
