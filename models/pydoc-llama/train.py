#!/usr/bin/env python
"""Train the project's embedded default model on Python stdlib docstrings.

Pipeline (CPU only, fully offline, seeded):
  1. extract the corpus with ``data/pydoc/make_corpus.py`` and (re)write ``data/pydoc/calib.txt``,
     ``data/pydoc/eval.txt`` and the (uncommitted) training text;
  2. train a byte-level BPE tokenizer (vocab 4096) on the training text;
  3. train a small Llama (or Qwen2) causal LM from scratch;
  4. evaluate perplexity on ``eval.txt`` and save everything atomically.

Examples:
  python models/pydoc-llama/train.py --data-only
  python models/pydoc-llama/train.py --output models/pydoc-llama --steps 900 --batch-size 4
  python models/pydoc-llama/train.py --eval-only --output models/pydoc-llama
  python models/pydoc-llama/train.py --arch qwen2 --steps 5 --output /tmp/pydoc-qwen2

Saving replaces the --output directory as a whole; this script, when it lives there
(the default output), is carried over into the new one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

# Passive OpenMP waiting: on a shared, oversubscribed CPU, spinning worker threads make a
# 2-thread run several times slower than 1 thread. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[2]
sys.path.insert(0, str(REPO / "data" / "pydoc"))
import make_corpus  # noqa: E402
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
ARCH = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", type=Path, default=REPO / "models/pydoc-llama")
    p.add_argument("--data-dir", type=Path, default=REPO / "data/pydoc",
                   help="where calib.txt / eval.txt live (committed)")
    p.add_argument("--train-text", type=Path, default=REPO / "out/pydoc/train.txt",
                   help="regenerated training text (not committed)")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="default: 5%% of steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200, help="0 disables mid-run eval")
    p.add_argument("--data-only", action="store_true",
                   help="only (re)write calib.txt, eval.txt and the training text")
    p.add_argument("--eval-only", action="store_true",
                   help="only measure eval perplexity of the model at --output")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data
def write_data(args) -> dict[str, list[str]]:
    return make_corpus.write_data(args.data_dir, args.train_text)


# ------------------------------------------------------------------------ tokenizer
def train_tokenizer(train_file: Path, vocab_size: int, arch: str = "llama"):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if arch == "qwen2":
        # AutoTokenizer always rebuilds a qwen2 checkpoint's tokenizer as Qwen2Tokenizer (NFC +
        # Qwen2 split regex); train with exactly that pipeline so the loaded ids match training.
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train([str(train_file)], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)],
    )
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2, 3]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", add_bos_token=True, add_eos_token=False,
        clean_up_tokenization_spaces=False, model_max_length=ARCH["max_position_embeddings"],
    )


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    smap = out_dir / "special_tokens_map.json"
    if not smap.exists():  # transformers 5 no longer writes it; keep it for older loaders
        smap.write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
            indent=2) + "\n")


def encode_stream(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one token stream: ``<s>`` + text (how eval.txt is scored)."""
    return torch.tensor(tokenizer(text, verbose=False).input_ids, dtype=torch.long)


# ---------------------------------------------------------------------------- model
def build_model(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "llama":
        cfg = LlamaConfig(**ARCH, head_dim=64, attention_bias=False, mlp_bias=False)
        cls = LlamaForCausalLM
    else:  # Qwen2: same sizes, q/k/v projections carry a bias as in Qwen2
        cfg = Qwen2Config(**ARCH, use_sliding_window=False)
        cls = Qwen2ForCausalLM
    cfg.dtype = torch.float32
    model = cls(cfg)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert mod.in_features % 128 == 0, (name, mod.in_features)
    return model


@torch.no_grad()
def eval_perplexity(model, stream: torch.Tensor, seq_len: int, batch_size: int = 8) -> float:
    """Perplexity over non-overlapping ``seq_len`` windows of ``stream`` (partial tail kept)."""
    model.eval()
    windows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    windows = [w for w in windows if len(w) > 1]
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        width = max(len(w) for w in chunk)
        ids = torch.full((len(chunk), width), ARCH["pad_token_id"], dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for j, w in enumerate(chunk):
            ids[j, :len(w)] = w
            labels[j, :len(w)] = w
        logits = model(input_ids=ids).logits[:, :-1].float()
        tgt = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100, reduction="sum")
        nll += loss.item()
        count += int((tgt != -100).sum())
    model.train()
    return math.exp(nll / count)


def batches(stream: torch.Tensor, seq_len: int, batch_size: int, bos_id: int, gen: torch.Generator):
    """Endless batches of random crops of the token stream, in shuffled epochs.

    Half of the windows start with ``<s>`` followed by ``seq_len - 1`` stream tokens, so
    the model handles both prompts that begin with BOS and raw mid-stream windows.
    """
    while True:
        offset = int(torch.randint(seq_len, (1,), generator=gen))
        starts = torch.arange(offset, len(stream) - seq_len, seq_len)
        starts = starts[torch.randperm(len(starts), generator=gen)]
        for i in range(0, len(starts) - batch_size + 1, batch_size):
            rows = []
            for s in starts[i:i + batch_size].tolist():
                if float(torch.rand((), generator=gen)) < 0.5:
                    rows.append(torch.cat([torch.tensor([bos_id]), stream[s:s + seq_len - 1]]))
                else:
                    rows.append(stream[s:s + seq_len])
            yield torch.stack(rows)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    ratio = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * ratio


# --------------------------------------------------------------------------- saving
MODEL_CARD = """# pydoc-{arch} ({n_params:.2f}M parameters)

A tiny {family} causal LM trained from scratch by this project, as the embedded default
model of the quantization workbench. It writes Python-documentation-style English.

* **Data**: docstrings of the Python {pyver} standard library (module/class/function
  docstrings extracted with `ast`, never imported) plus the pydoc help topics
  (`pydoc_data/topics.py`). Split per source file by SHA-1 of the relative path;
  held-out calibration/eval text ships in `data/pydoc/` (see its README).
  License of the text: Python Software Foundation License (PSF-2.0), as the stdlib.
* **Tokenizer**: byte-level BPE, vocab 4096, trained on the training split;
  `<unk>`=0, `<s>`=1 (prepended by the tokenizer), `</s>`=2, `<pad>`=3.
* **Architecture**: hidden 256, intermediate 768, 6 layers, 4 query heads / 2 KV heads
  (GQA), head_dim 64, RoPE theta 10000, RMSNorm eps 1e-5, untied `lm_head` (4096x256),
  max positions 1024, float32 safetensors.
* **Training**: `{command}`
  * {steps} steps x batch {batch} x seq {seq} = {tokens:,} tokens seen
    ({epochs:.1f} passes over the {train_tokens:,}-token training stream),
    AdamW (lr {lr}, betas 0.9/0.95, wd {wd}), {warmup} warmup steps then cosine to
    {min_lr}x, grad clip 1.0, seed {seed}, {threads} CPU threads.
  * final train loss (mean of the last {tail} steps): {final_loss:.3f}
  * wall time of the training loop: {train_min:.1f} min ({tok_s:.0f} tokens/s);
    whole script: {total_min:.1f} min.
* **Eval perplexity** on `data/pydoc/eval.txt`: **{ppl:.2f}** (calib.txt: {calib_ppl:.2f}).
  Whole file tokenized as one stream (`<s>` + text), non-overlapping 256-token windows,
  mean NLL over all predicted tokens. Measure with:
  `python models/pydoc-llama/train.py --eval-only --output {out_rel}`

Use:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("{out_rel}")
model = AutoModelForCausalLM.from_pretrained("{out_rel}")
ids = tok("Return the number of", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0]))
```
"""


def atomic_save(out: Path, write_fn) -> None:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_fn(tmp)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------- main
def run_eval_only(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.output)
    model = AutoModelForCausalLM.from_pretrained(args.output, dtype=torch.float32)
    for name in ("eval", "calib"):
        stream = encode_stream(tok, (args.data_dir / f"{name}.txt").read_text(encoding="utf-8"))
        ppl = eval_perplexity(model, stream, args.seq_len)
        print(f"{name}.txt: {len(stream)} tokens, perplexity {ppl:.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.eval_only:
        return run_eval_only(args)
    t_start = time.time()
    corpus = write_data(args)
    if args.data_only:
        return
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)

    torch.manual_seed(args.seed)
    tokenizer = train_tokenizer(args.train_text, ARCH["vocab_size"], args.arch)
    train_stream = encode_stream(tokenizer, args.train_text.read_text(encoding="utf-8"))
    eval_stream = encode_stream(tokenizer, (args.data_dir / "eval.txt").read_text(encoding="utf-8"))
    calib_stream = encode_stream(tokenizer, (args.data_dir / "calib.txt").read_text(encoding="utf-8"))
    print(f"tokens: train {len(train_stream):,}  eval {len(eval_stream):,}  calib {len(calib_stream):,}")

    torch.manual_seed(args.seed)
    model = build_model(args.arch)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.arch}: {n_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_stream, args.seq_len, args.batch_size, tokenizer.bos_token_id, gen)

    losses: list[float] = []
    t_train = time.time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        ids = next(data)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = sum(losses[-args.log_every:]) / len(losses[-args.log_every:])
            tok_s = (step + 1) * ids.numel() / (time.time() - t_train)
            tqdm.write(f"step {step + 1}/{args.steps} loss {recent:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                       f"{tok_s:.0f} tok/s")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            tqdm.write(f"step {step + 1} eval ppl {eval_perplexity(model, eval_stream, args.seq_len):.2f}")
    train_s = time.time() - t_train
    tokens_seen = args.steps * args.batch_size * args.seq_len

    ppl = eval_perplexity(model, eval_stream, args.seq_len)
    calib_ppl = eval_perplexity(model, calib_stream, args.seq_len)
    tail = min(50, len(losses))
    final_loss = sum(losses[-tail:]) / tail
    print(f"final train loss {final_loss:.4f}  eval ppl {ppl:.2f}  calib ppl {calib_ppl:.2f}  "
          f"tokens {tokens_seen:,}  train time {train_s / 60:.1f} min")

    command = "python models/pydoc-llama/train.py " + " ".join(
        a if not a.startswith("/") else rel(Path(a)) for a in (argv if argv is not None else sys.argv[1:]))
    card = MODEL_CARD.format(
        arch=args.arch, family={"llama": "Llama", "qwen2": "Qwen2"}[args.arch], n_params=n_params / 1e6,
        pyver=".".join(map(str, sys.version_info[:3])), command=command.strip(), steps=args.steps,
        batch=args.batch_size, seq=args.seq_len, tokens=tokens_seen, epochs=tokens_seen / len(train_stream),
        train_tokens=len(train_stream), lr=args.lr, wd=args.weight_decay, warmup=args.warmup,
        min_lr=args.min_lr_ratio, seed=args.seed, threads=args.threads, tail=tail, final_loss=final_loss,
        train_min=train_s / 60, tok_s=tokens_seen / train_s, total_min=(time.time() - t_start) / 60,
        ppl=ppl, calib_ppl=calib_ppl, out_rel=rel(args.output),
    )

    def write(tmp: Path) -> None:
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)
        (tmp / "README.md").write_text(card)
        if SCRIPT.parent == args.output.resolve():  # the directory is replaced: keep this script in it
            shutil.copy2(SCRIPT, tmp / SCRIPT.name)
        for f in tmp.iterdir():
            f.chmod(0o644)

    atomic_save(args.output, write)
    print(f"saved to {args.output}")


if __name__ == "__main__":
    main()
