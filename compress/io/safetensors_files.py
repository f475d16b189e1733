"""Reading and writing safetensors files one tensor at a time.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{...}}`` (which may end in spaces), then the tensors' bytes back to back, offsets
relative to the end of the header.

* :class:`SafetensorsFile` parses one file's header and reads any tensor by a positioned
  read straight into a new tensor: nothing else of the file is touched, so a 13 GB
  checkpoint costs only the tensors asked for.
* :class:`TensorStore` is a model directory: ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``. It checks that the index and the shards agree (every
  listed shard present, every tensor where the index says, none unlisted) and names the
  shard of any problem.
* :class:`ShardedWriter` writes tensors as they come into shards of at most
  ``max_shard_bytes``: each tensor goes to disk at once (into a shard file that starts
  with a reserved header region), so the writer holds no tensor data. ``finish`` writes
  the headers, names the shards ``model-0000k-of-0000n.safetensors`` (one shard:
  ``model.safetensors``) and the index.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.errors import UserError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024        # the limit the reference implementation enforces
RESERVED_HEADER_BYTES = 256 * 1024          # header room at the start of a streamed shard

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(UserError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int          # absolute offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One safetensors file: its header parsed, tensors read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.entries, self.metadata = _parse_header(self.path)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        return self.read_rows(name, 0, e.shape[0] if e.shape else 1) if e.shape else self._read(name, 0, 1, ())

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (its first dimension), as stored: a part
        of a large tensor without the rest (a loader converting it a slice at a time)."""
        e = self.entries[name]
        if not e.shape or not 0 <= start <= stop <= e.shape[0]:
            raise SafetensorsError(f"{self.path}: tensor {name!r} of shape {list(e.shape)} has no rows "
                                   f"[{start}, {stop})")
        return self._read(name, start, stop, (stop - start, *e.shape[1:]))

    def _read(self, name: str, start: int, stop: int, shape) -> torch.Tensor:
        e = self.entries[name]
        out = torch.empty(shape, dtype=e.dtype)
        row = e.nbytes // e.shape[0] if e.shape and e.shape[0] else e.nbytes
        want = out.numel() * e.dtype.itemsize
        if want:
            buf = memoryview(out.view(-1).view(torch.uint8).numpy())
            with open(self.path, "rb") as f:
                f.seek(e.begin + start * row)
                got = f.readinto(buf)
            if got != want:
                raise SafetensorsError(f"{self.path}: truncated while reading tensor {name!r} "
                                       f"({got} of {want} bytes)")
        return out


def _parse_header(path: Path) -> tuple[dict[str, TensorEntry], dict]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SafetensorsError(f"{path}: truncated or corrupted safetensors file (header of {n} bytes "
                                       f"in a {size}-byte file)")
            raw = f.read(n)
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsError(f"{path}: corrupted safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has an invalid header entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise SafetensorsError(f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) has "
                                   f"{end - begin} bytes of data, not {numel * dtype.itemsize}")
        if data_start + end > size:
            raise SafetensorsError(f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} "
                                   f"of a {size}-byte file")
        entries[name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


class TensorStore:
    """The safetensors weights of a model directory, by tensor name, read on demand."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}          # tensor name -> file name
        index = self.directory / SAFE_INDEX_NAME
        if index.is_file():
            self._open_index(index)
        else:
            paths = sorted(self.directory.glob("*.safetensors"))
            if not paths:
                raise SafetensorsError(f"no *.safetensors weight files in {self.directory}")
            for p in paths:
                self._add_file(p.name)

    def _add_file(self, fname: str) -> SafetensorsFile:
        f = SafetensorsFile(self.directory / fname)
        self.files[fname] = f
        for name in f.entries:
            if name in self.location:
                raise SafetensorsError(f"tensor {name!r} is in both {self.location[name]} and {fname} "
                                       f"({self.directory})")
            self.location[name] = fname
        return f

    def _open_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise SafetensorsError(f"{index}: not a valid safetensors index ({exc})") from None
        for fname in sorted(set(weight_map.values())):
            if not (self.directory / fname).is_file():
                raise SafetensorsError(f"{index} lists shard {fname}, which is missing from {self.directory}")
            self._add_file(fname)
        for name, fname in weight_map.items():
            if self.location.get(name) != fname:
                where = f"it is in {self.location[name]}" if name in self.location else "no shard holds it"
                raise SafetensorsError(f"{index} puts tensor {name!r} in {fname}, but {where}")
        unlisted = sorted(set(self.location) - set(weight_map))
        if unlisted:
            raise SafetensorsError(f"{index} does not list tensor {unlisted[0]!r} of shard "
                                   f"{self.location[unlisted[0]]} ({len(unlisted)} unlisted tensor(s))")

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        return list(self.location)

    def entry(self, name: str) -> TensorEntry:
        return self.files[self.location[name]].entries[name]

    def read(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise SafetensorsError(f"{self.directory}: no tensor {name!r} in its safetensors files")
        return self.files[self.location[name]].read(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.location:
            raise SafetensorsError(f"{self.directory}: no tensor {name!r} in its safetensors files")
        return self.files[self.location[name]].read_rows(name, start, stop)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for f in self.files.values() for e in f.entries.values())

    def first_float_dtype(self) -> torch.dtype | None:
        for f in self.files.values():
            for e in f.entries.values():
                if e.dtype.is_floating_point:
                    return e.dtype
        return None


class _Shard:
    def __init__(self, path: Path, reserved: int):
        self.path, self.reserved = path, reserved
        self.file = open(path, "wb")
        self.file.seek(reserved)
        self.header: dict[str, dict] = {}
        self.size = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self.file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.size, self.size + nbytes]}
        self.size += nbytes

    def close(self, metadata: dict) -> None:
        header = json.dumps({"__metadata__": metadata, **self.header}, separators=(",", ":")).encode()
        room = self.reserved - 8
        if len(header) <= room:
            self.file.seek(0)
            self.file.write(struct.pack("<Q", room) + header + b" " * (room - len(header)))
            self.file.close()
            return
        # more tensors than the reserved room holds: rewrite the file with a bigger header
        self.file.close()
        n = -(-len(header) // 8) * 8
        tmp = self.path.with_name(self.path.name + ".grow")
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(struct.pack("<Q", n) + header + b" " * (n - len(header)))
            src.seek(self.reserved)
            while chunk := src.read(64 << 20):
                dst.write(chunk)
        os.replace(tmp, self.path)


class ShardedWriter:
    """Streams tensors into ``directory`` as safetensors shards (see module doc)."""

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int,
                 metadata: dict | None = None, reserved_header: int = RESERVED_HEADER_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.directory = Path(directory)
        self.max_shard_bytes, self.reserved = max_shard_bytes, reserved_header
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[_Shard] = []
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise SafetensorsError(f"tensor {name!r} written twice")
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in DTYPE_NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        if not self.shards or (self.shards[-1].header and self.shards[-1].size + nbytes > self.max_shard_bytes):
            self.shards.append(_Shard(self.directory / f".shard-{len(self.shards) + 1:05d}.part", self.reserved))
        self.shards[-1].add(name, t)
        self.names.add(name)

    def finish(self) -> list[str]:
        """Close every shard, give it its final name, write the index when there are
        several; returns the file names written."""
        if not self.shards:                       # a model with no tensors still gets a file
            self.shards.append(_Shard(self.directory / ".shard-00001.part", self.reserved))
        n = len(self.shards)
        weight_map, total, written = {}, 0, []
        for i, shard in enumerate(self.shards, 1):
            shard.close(self.metadata)
            fname = SAFE_WEIGHTS_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(shard.path, self.directory / fname)
            written.append(fname)
            total += shard.size
            weight_map.update({k: fname for k in shard.header})
        if n > 1:
            (self.directory / SAFE_INDEX_NAME).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                           indent=2) + "\n", encoding="utf-8")
            written.append(SAFE_INDEX_NAME)
        return written

    def abort(self) -> None:
        for shard in self.shards:
            if not shard.file.closed:
                shard.file.close()
