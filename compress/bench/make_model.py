"""``compress bench make-model``: the end-to-end benchmark model. A random-init Llama
(by default hidden 1024, 24 layers, intermediate 2816, 16 heads, 8 kv heads, vocab
32000: ~345M parameters), saved as a plain HF directory plus its RTN int4 (group 128)
and int8 exports, the lm_head in int8 in both unless ``--lm-head dense`` (llama.cpp's
Q4_0 and Q8_0 files keep ``output.weight`` in Q6_K and Q8_0, and a dense fp32 head
would read 131 MB per token)::

    compress bench make-model --out out/bench-llama
    -> out/bench-llama/hf, out/bench-llama/rtn-int4, out/bench-llama/rtn-int8

The tokenizer is the embedded model's (models/pydoc-llama), plus a small SentencePiece
model (``tokenizer.model``, trained on this package's sources) because llama.cpp's
converter does not recognise the embedded BPE pre-tokenizer; the benchmark feeds token
ids and ignores EOS, so neither tokenizer changes the figures."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from compress.errors import UserError
from compress.io.files import atomic_dir

PACKAGE = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = PACKAGE.parent / "models" / "pydoc-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class MakeModelError(UserError):
    """A setting of ``compress bench make-model`` that cannot work (names the option or path)."""


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


def _save_hf_dir(model, hf: Path, tokenizer_from: Path | None, sentencepiece: bool, log) -> None:
    """The dense model and its tokenizer files in ``hf``, written beside it and renamed
    into place (an older ``hf`` is replaced)."""
    if hf.exists() and (not hf.is_dir() or (any(hf.iterdir()) and not (hf / "config.json").is_file())):
        raise MakeModelError(f"refusing to replace {hf}: it exists and holds no config.json (not a model "
                             "this command wrote)")
    with atomic_dir(hf) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES if tokenizer_from is not None else ():
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, tmp / name)
        if sentencepiece:
            train_sentencepiece(tmp, log)


def make_bench_model(out: Path, *, hidden: int = 1024, layers: int = 24, intermediate: int = 2816,
                     heads: int = 16, kv_heads: int = 8, vocab: int = 32000, max_positions: int = 2048,
                     group_size: int | str = 128, lm_head: str = "int8", tokenizer_from: Path | str | None = EMBEDDED_MODEL,
                     sentencepiece: bool = True, seed: int = 0, log=print) -> dict[str, Path]:
    """Writes ``out/hf`` (dense), ``out/rtn-int4`` and ``out/rtn-int8``; returns them by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from compress.io.export import export_checkpoint
    from quantizers.rtn import RTNConfig, quantize_weight_rtn

    out = Path(out)
    if tokenizer_from is not None and not Path(tokenizer_from).is_dir():
        raise MakeModelError(f"--tokenizer-from {tokenizer_from}: no such directory ('none' for no tokenizer files)")
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    paths = {"hf": out / "hf"}
    _save_hf_dir(model, paths["hf"], None if tokenizer_from is None else Path(tokenizer_from), sentencepiece, log)
    log(f"wrote {paths['hf']} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")
    has_tokenizer = any((paths["hf"] / f).exists() for f in (*TOKENIZER_FILES, "tokenizer.model"))
    sd = model.state_dict()
    for name, rtn in (("rtn-int4", RTNConfig(bits=4, group_size=group_size)), ("rtn-int8", RTNConfig(bits=8))):
        quantized = {}
        for mod_name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in mod_name:
                quantized[mod_name] = quantize_weight_rtn(mod.weight.data, rtn, mod_name)
        if lm_head == "int8":
            quantized["lm_head"] = quantize_weight_rtn(model.lm_head.weight.data, RTNConfig(bits=8), "lm_head")
        dense = {k: v for k, v in sd.items() if k.removesuffix(".weight") not in quantized}
        paths[name] = export_checkpoint(out / name, cfg, dense, quantized, tokenizer=str(paths["hf"]) if has_tokenizer else None)
        log(f"wrote {paths[name]}")
    return paths


def _group_size(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def main(args) -> int:
    tokenizer_from = None if args.tokenizer_from == "none" else Path(args.tokenizer_from)
    make_bench_model(Path(args.out), hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
                     heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, max_positions=args.max_positions,
                     group_size=args.group_size, lm_head=args.lm_head, tokenizer_from=tokenizer_from,
                     sentencepiece=not args.no_sentencepiece, seed=args.seed)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/bench-llama", help="writes OUT/hf, OUT/rtn-int4 and OUT/rtn-int8")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--group-size", type=_group_size, default=128,
                   help="int4 group size of the rtn-int4 export (or 'channel': one scale per row)")
    p.add_argument("--tokenizer-from", default=str(EMBEDDED_MODEL),
                   help="copy the tokenizer files of this directory ('none': no tokenizer files)")
    p.add_argument("--no-sentencepiece", action="store_true",
                   help="no tokenizer.model (llama.cpp's converter needs it; the compress runtime does not)")
    p.add_argument("--lm-head", choices=["int8", "dense"], default="int8",
                   help="lm_head in the quantized exports: int8 (as llama.cpp's Q4_0/Q8_0 files keep "
                        "output.weight in 6/8 bits; the default) or the dense fp32 weight")
    p.add_argument("--seed", type=int, default=0)
