"""``compress bench make-model``: the end-to-end benchmark model. A random-init Llama
(by default hidden 1024, 24 layers, intermediate 2816, 16 heads, 8 kv heads, vocab
32000: ~345M parameters; ``--preset llama-2-7b`` for Llama-2-7B's shape), saved as a
plain HF directory plus its RTN int4 (group 128) and int8 exports, the lm_head in int8
in both unless ``--lm-head dense`` (llama.cpp's Q4_0 and Q8_0 files keep
``output.weight`` in Q6_K and Q8_0, and a dense fp32 head would read 131 MB per token)::

    compress bench make-model --out out/bench-llama
    -> out/bench-llama/hf, out/bench-llama/rtn-int4, out/bench-llama/rtn-int8
    compress bench make-model --preset llama-2-7b --dtype bfloat16 --exports none --out /data/bench7b
    -> /data/bench7b/hf (13.5 GB in 3 shards of at most 5 GB)

The HF directory is written tensor by tensor, so memory stays at about one tensor
whatever the model's size: the model is built on the meta device only for its tensors'
names and shapes; each tensor is drawn from its own generator (seeded by ``--seed`` and
its name; Linear and Embedding weights ~ N(0, 0.02) as transformers initialises them,
RMSNorm weights 1), cast to ``--dtype`` and streamed into safetensors shards named and
indexed as Hugging Face names them (one shard: ``model.safetensors``, no index). The
exports read the written shards back one tensor at a time.

The tokenizer is the embedded model's (models/pydoc-llama), plus a small SentencePiece
model (``tokenizer.model``, trained on this package's sources) because llama.cpp's
converter does not recognise the embedded BPE pre-tokenizer; the benchmark feeds token
ids and ignores EOS, so neither tokenizer changes the figures."""
from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.errors import UserError
from compress.io.files import atomic_dir
from compress.io.safetensors_files import ShardedWriter, TensorStore

PACKAGE = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = PACKAGE.parent / "models" / "pydoc-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

SHAPE_KEYS = ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab", "max_positions")
DEFAULT_SHAPE = dict(hidden=1024, layers=24, intermediate=2816, heads=16, kv_heads=8, vocab=32000, max_positions=2048)
PRESETS = {  # --preset -> shape (options given beside it override single values)
    "llama-2-7b": dict(hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32, vocab=32000,
                       max_positions=4096),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORTS = {"both": ("rtn-int4", "rtn-int8"), "int4": ("rtn-int4",), "int8": ("rtn-int8",), "none": ()}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # as Hugging Face's Llama checkpoints are cut
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class MakeModelError(UserError):
    """A setting of ``compress bench make-model`` that cannot work (names the option or path)."""


# ---------------------------------------------------------------- settings
def parse_size(text: str | int) -> int:
    """Bytes from ``5000000``, ``'5GB'`` (10**9) or ``'4GiB'`` (2**30)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise MakeModelError(f"--max-shard-size {text!r}: not a size (bytes, or e.g. '5GB', '500MiB')")
        size = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise MakeModelError(f"--max-shard-size {text!r}: must be more than 0 bytes")
    return size


def resolve_shape(preset: str | None = None, **given: int | None) -> dict[str, int]:
    """The model's shape: the default, or ``preset``'s, with every value in ``given``
    that is not None put over it."""
    if preset is not None and preset not in PRESETS:
        raise MakeModelError(f"--preset {preset!r}: unknown; choose one of {sorted(PRESETS)}")
    unknown = sorted(set(given) - set(SHAPE_KEYS))
    if unknown:
        raise MakeModelError(f"unknown shape settings {unknown}; the shape is {list(SHAPE_KEYS)}")
    shape = dict(PRESETS[preset] if preset else DEFAULT_SHAPE)
    shape.update({k: v for k, v in given.items() if v is not None})
    return shape


def bench_config(shape: dict[str, int], dtype: torch.dtype):
    """The LlamaConfig of the benchmark model (untied head, BOS 1 / EOS 2, ``dtype`` as
    the stored dtype)."""
    from transformers import LlamaConfig

    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise MakeModelError(f"--hidden {shape['hidden']} / --heads {shape['heads']} / --kv-heads {shape['kv_heads']}: "
                             "the hidden size must be a multiple of the heads, and the heads of the kv heads")
    try:
        return LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                           intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
                           num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                           max_position_embeddings=shape["max_positions"], tie_word_embeddings=False, bos_token_id=1,
                           eos_token_id=2, dtype=dtype, architectures=["LlamaForCausalLM"])
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise their own types
        raise MakeModelError(f"LlamaConfig refuses the shape {shape}: {str(exc).strip().splitlines()[-1]}") from None


# ---------------------------------------------------------------- the tensors
@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model: its state-dict name, shape, how it is initialised
    (``normal``: N(0, initializer_range); ``ones``) and whether the exports quantize it
    (the Linear layers of the decoder blocks)."""
    name: str
    shape: tuple[int, ...]
    init: str
    quantized: bool = False

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def tensor_specs(cfg) -> list[TensorSpec]:
    """The tensors of ``LlamaForCausalLM(cfg)`` in state-dict order, read from a model
    built on the meta device (no memory for the weights)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    owner = {}
    for mod_name, mod in model.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            owner[f"{mod_name}.{p_name}" if mod_name else p_name] = (mod_name, mod)
    specs = []
    for name, t in model.state_dict().items():
        mod_name, mod = owner[name]
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and name.endswith(".weight"):
            init = "normal"
        elif type(mod).__name__.endswith("RMSNorm") and name.endswith(".weight"):
            init = "ones"
        else:
            raise MakeModelError(f"tensor {name} ({type(mod).__name__}): no initialisation rule for it")
        quantized = isinstance(mod, torch.nn.Linear) and ".layers." in mod_name
        specs.append(TensorSpec(name, tuple(t.shape), init, quantized))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: the same for a seed whatever the dtype,
    the sharding or which other tensors are written."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def initial_tensor(spec: TensorSpec, std: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """One tensor's random-init value, drawn in float32 and cast to ``dtype``."""
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return torch.empty(spec.shape, dtype=torch.float32).normal_(0.0, std, generator=g).to(dtype)


# ---------------------------------------------------------------- the weights
def write_weights(dest: Path, specs: list[TensorSpec], dtype: torch.dtype, std: float, seed: int,
                  max_shard_bytes: int) -> list[str]:
    """The model's random-init weights in ``dest`` as Hugging Face shards (and their
    index when there are several), each tensor made only when its turn comes and written
    at once; returns the file names written."""
    writer = ShardedWriter(dest, max_shard_bytes)
    try:
        for spec in specs:
            writer.add(spec.name, initial_tensor(spec, std, seed, dtype))
        return writer.finish()
    finally:
        writer.abort()


# ---------------------------------------------------------------- the directories
def train_sentencepiece(out_dir: Path, log=print) -> bool:
    """``out_dir/tokenizer.model``: a 1000-piece BPE SentencePiece model trained on this
    package's sources; False (and a note) where sentencepiece is not installed."""
    try:
        import sentencepiece as spm
    except ImportError:
        log("sentencepiece not installed: no tokenizer.model (llama.cpp's converter will refuse the model)")
        return False
    corpus = out_dir / "spm_corpus.txt"
    corpus.write_text("\n".join(f.read_text(errors="ignore") for f in sorted(PACKAGE.rglob("*.py"))))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out_dir / "tokenizer"), vocab_size=1000,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    corpus.unlink()
    (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
    return True


def _save_hf_dir(write_model, hf: Path, tokenizer_from: Path | None, sentencepiece: bool, log) -> None:
    """``write_model(tmp)`` (config, weights) and the tokenizer files in ``hf``, written
    beside it and renamed into place (an older ``hf`` is replaced)."""
    if hf.exists() and (not hf.is_dir() or (any(hf.iterdir()) and not (hf / "config.json").is_file())):
        raise MakeModelError(f"refusing to replace {hf}: it exists and holds no config.json (not a model "
                             "this command wrote)")
    with atomic_dir(hf) as tmp:
        write_model(tmp)
        for name in TOKENIZER_FILES if tokenizer_from is not None else ():
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, tmp / name)
        if sentencepiece:
            train_sentencepiece(tmp, log)


def _write_export(out: Path, hf: Path, cfg, specs: list[TensorSpec], bits: int, group_size: int | str,
                  lm_head: str, tokenizer: str | None) -> Path:
    """The RTN export of the model in ``hf``, streamed tensor by tensor: its decoder
    Linear weights in ``bits`` (int4 with ``group_size``), the lm_head in int8 when
    ``lm_head == 'int8'``, every other tensor as stored."""
    from compress.io.export import CheckpointWriter
    from quantizers.rtn import RTNConfig, quantize_weight_rtn

    rtn = RTNConfig(bits=4, group_size=group_size) if bits == 4 else RTNConfig(bits=8)
    quantized = {s.name.removesuffix(".weight"): rtn for s in specs if s.quantized}
    if lm_head == "int8":
        quantized["lm_head"] = RTNConfig(bits=8)
    store = TensorStore(hf)
    with CheckpointWriter(out) as w:
        for name in store.names():
            mod = name.removesuffix(".weight")
            if mod in quantized:
                w.add_quantized(mod, quantize_weight_rtn(store.read(name).float(), quantized[mod], mod))
            else:
                w.add_dense(name, store.read(name))
        w.finish(cfg, tokenizer=tokenizer)
    return w.out_dir


def make_bench_model(out: Path, *, hidden: int = 1024, layers: int = 24, intermediate: int = 2816,
                     heads: int = 16, kv_heads: int = 8, vocab: int = 32000, max_positions: int = 2048,
                     dtype: str = "float32", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                     exports: str = "both", group_size: int | str = 128, lm_head: str = "int8",
                     tokenizer_from: Path | str | None = EMBEDDED_MODEL, sentencepiece: bool = True, seed: int = 0,
                     log=print) -> dict[str, Path]:
    """Writes ``out/hf`` (dense, in ``dtype``) and the ``exports`` (``both``:
    ``out/rtn-int4`` and ``out/rtn-int8``; ``int4``, ``int8``, ``none``); returns them by
    name."""
    from transformers import GenerationConfig

    out = Path(out)
    if tokenizer_from is not None and not Path(tokenizer_from).is_dir():
        raise MakeModelError(f"--tokenizer-from {tokenizer_from}: no such directory ('none' for no tokenizer files)")
    if dtype not in DTYPES:
        raise MakeModelError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    if exports not in EXPORTS:
        raise MakeModelError(f"--exports {exports!r}: choose one of {sorted(EXPORTS)}")
    max_shard_bytes = parse_size(max_shard_size)
    shape = resolve_shape(hidden=hidden, layers=layers, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                          vocab=vocab, max_positions=max_positions)
    cfg = bench_config(shape, DTYPES[dtype])
    specs = tensor_specs(cfg)
    shards = []

    def write_model(tmp: Path) -> None:
        cfg.save_pretrained(tmp)
        GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
        shards.extend(write_weights(tmp, specs, DTYPES[dtype], cfg.initializer_range, seed, max_shard_bytes))

    paths = {"hf": out / "hf"}
    _save_hf_dir(write_model, paths["hf"], None if tokenizer_from is None else Path(tokenizer_from), sentencepiece, log)
    n_shards = sum(f.endswith(".safetensors") for f in shards)
    log(f"wrote {paths['hf']} ({sum(s.numel() for s in specs) / 1e6:.0f}M parameters, {dtype}, "
        f"{n_shards} shard{'s' if n_shards > 1 else ''})")
    has_tokenizer = any((paths["hf"] / f).exists() for f in (*TOKENIZER_FILES, "tokenizer.model"))
    for name in EXPORTS[exports]:
        paths[name] = _write_export(out / name, paths["hf"], cfg, specs, 4 if name == "rtn-int4" else 8, group_size,
                                    lm_head, str(paths["hf"]) if has_tokenizer else None)
        log(f"wrote {paths[name]}")
    return paths


def _group_size(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def main(args) -> int:
    tokenizer_from = None if args.tokenizer_from == "none" else Path(args.tokenizer_from)
    shape = resolve_shape(args.preset, **{k: getattr(args, k) for k in SHAPE_KEYS})
    make_bench_model(Path(args.out), **shape, dtype=args.dtype, max_shard_size=args.max_shard_size,
                     exports=args.exports, group_size=args.group_size, lm_head=args.lm_head,
                     tokenizer_from=tokenizer_from, sentencepiece=not args.no_sentencepiece, seed=args.seed)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/bench-llama",
                   help="writes OUT/hf and the exports (OUT/rtn-int4, OUT/rtn-int8)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a known model's shape (llama-2-7b: hidden 4096, 32 layers, intermediate 11008, 32 heads, "
                        "32 kv heads, vocab 32000, 4096 positions); the shape options below override single values")
    for key in SHAPE_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"default {DEFAULT_SHAPE[key]} (or the preset's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the HF directory's weights")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest safetensors shard of the HF directory: bytes, or e.g. '5GB', '2GiB' (default "
                        f"{DEFAULT_MAX_SHARD_SIZE}; one shard is named model.safetensors, several get an index)")
    p.add_argument("--exports", choices=sorted(EXPORTS), default="both",
                   help="RTN exports to write beside the HF directory: both (rtn-int4 and rtn-int8), int4, int8 "
                        "or none")
    p.add_argument("--group-size", type=_group_size, default=128,
                   help="int4 group size of the rtn-int4 export (or 'channel': one scale per row)")
    p.add_argument("--tokenizer-from", default=str(EMBEDDED_MODEL),
                   help="copy the tokenizer files of this directory ('none': no tokenizer files)")
    p.add_argument("--no-sentencepiece", action="store_true",
                   help="no tokenizer.model (llama.cpp's converter needs it; the compress runtime does not)")
    p.add_argument("--lm-head", choices=["int8", "dense"], default="int8",
                   help="lm_head in the quantized exports: int8 (as llama.cpp's Q4_0/Q8_0 files keep "
                        "output.weight in 6/8 bits; the default) or the dense weight as stored")
    p.add_argument("--seed", type=int, default=0)
