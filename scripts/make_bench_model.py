"""Builds the end-to-end benchmark model of issue 3: a random-init Llama (hidden 1024,
24 layers, intermediate 2816, 16 heads, 8 kv heads, vocab 32000; ~345M parameters),
saved as a plain HF directory plus its RTN int4 (group 128) and int8 exports (the
lm_head in int8 in both unless ``--lm-head dense``: llama.cpp's Q4_0 and Q8_0 files keep
``output.weight`` in Q6_K and Q8_0, and a dense fp32 head would read 131 MB per token):

    python scripts/make_bench_model.py --out out/bench-llama
    -> out/bench-llama/hf, out/bench-llama/rtn-int4, out/bench-llama/rtn-int8

The tokenizer is the embedded model's (models/pydoc-llama), plus a small SentencePiece
model (``tokenizer.model``, trained on this package's sources) because llama.cpp's
converter does not recognise the embedded BPE pre-tokenizer; the benchmark feeds token
ids and ignores EOS, so neither tokenizer changes the figures.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compress.io.export import export_checkpoint
from quantizers.rtn import RTNConfig, quantize_weight_rtn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _train_sentencepiece(hf: Path) -> None:
    try:
        import sentencepiece as spm
    except ImportError:
        print("sentencepiece not installed: no tokenizer.model (llama.cpp conversion will fail)")
        return
    root = Path(__file__).resolve().parent.parent / "compress"
    corpus = hf / "spm_corpus.txt"
    corpus.write_text("\n".join(f.read_text(errors="ignore") for f in sorted(root.rglob("*.py"))))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(hf / "tokenizer"), vocab_size=1000,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    corpus.unlink()
    (hf / "tokenizer.vocab").unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="out/bench-llama")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokenizer-from", default="models/pydoc-llama")
    p.add_argument("--lm-head", choices=["int8", "dense"], default="int8",
                   help="lm_head in the quantized exports: int8 (as llama.cpp's Q4_0/Q8_0 files keep "
                        "output.weight in 6/8 bits; the default) or the dense fp32 weight")
    args = p.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    hf = out / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    for f in TOKENIZER_FILES:
        src = Path(args.tokenizer_from) / f
        if src.exists():
            shutil.copy(src, hf / f)
    _train_sentencepiece(hf)
    print(f"wrote {hf} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")
    sd = model.state_dict()
    for name, rtn in (("rtn-int4", RTNConfig(bits=4, group_size=128)), ("rtn-int8", RTNConfig(bits=8))):
        quantized = {}
        for mod_name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in mod_name:
                quantized[mod_name] = quantize_weight_rtn(mod.weight.data, rtn, mod_name)
        if args.lm_head == "int8":
            quantized["lm_head"] = quantize_weight_rtn(model.lm_head.weight.data, RTNConfig(bits=8), "lm_head")
        dense = {k: v for k, v in sd.items() if k.removesuffix(".weight") not in quantized}
        path = export_checkpoint(out / name, cfg, dense, quantized, tokenizer=str(hf))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
