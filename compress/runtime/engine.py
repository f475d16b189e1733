"""``LLM``: the vLLM-shaped entry point of the compress runtime.

    llm = LLM("out/quickstart/int4")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    for delta in llm.stream("Hello", SamplingParams(max_tokens=32)): print(delta, end="")
    llm.loglikelihood([(context_ids, continuation_ids)])   # evals
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator, Sequence as Seq

import torch

from compress.ops import BACKENDS
from compress.runtime import scoring
from compress.runtime.layers import Int4Linear
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS
from compress.runtime.loading import open_checkpoint
from compress.dtypes import resolve_dtype
from compress.runtime.model_runner import ModelRunner
from compress.runtime.models.llama import build_model
from compress.runtime.sampling import BatchSampler, SamplingParams
from compress.runtime.scheduler import RequestOutput, Scheduler, Sequence
from compress.runtime.scoring import Loglikelihood



class LLM:
    """Loads a checkpoint (exported by compress, or a plain HF directory) and serves it.

    ``kernels``: 'native' (compiled kernels where available, else the reference) or
    'reference' (the pure-PyTorch ops). ``max_seq_len`` defaults to the config's
    ``max_position_embeddings``. ``threads`` sets torch's intra-op threads.
    ``kv_cache_dtype``: the KV cache's element type, ``None`` for the model's ``dtype``
    (exact) or ``"float16"`` (half the cache bytes a decode step reads, as llama.cpp
    keeps its cache; keys and values are rounded to fp16 when stored).
    ``w4_activations``: how int4 (w4a16) layers treat their activations. ``"float"`` (the
    default): as the scheme and its compressed-tensors export say, activations in the
    model's dtype against each weight dequantized in fp32, so the logits are what
    transformers computes on the same export (to fp32 rounding). ``"int8"``: the CPU fast
    path, activations quantized to int8 per block of 32 along K as llama.cpp does
    (faster int4 kernels; logits ~0.4% off). The attribute ``w4_activations`` says what
    the model's int4 layers run with, ``None`` when it has none."""

    def __init__(self, path, dtype="float32", kernels: str = "native", device: str = "cpu",
                 max_seq_len: int | None = None, threads: int | None = None, max_batch_size: int = 32,
                 kv_cache_dtype=None, w4_activations: str = DEFAULT_W4_ACTIVATIONS):
        ckpt = open_checkpoint(path)
        directory = Path(getattr(ckpt, "path", None) or path)
        self.checkpoint_path = directory
        self._setup(ckpt, dtype, kernels, device, max_seq_len, threads, max_batch_size,
                    tokenizer=_load_tokenizer(ckpt.tokenizer_path),
                    generation_config=_read_json(directory / "generation_config.json"),
                    kv_cache_dtype=kv_cache_dtype, w4_activations=w4_activations)

    @classmethod
    def from_checkpoint(cls, ckpt, tokenizer=None, dtype="float32", kernels: str = "native",
                        device: str = "cpu", max_seq_len: int | None = None, threads: int | None = None,
                        max_batch_size: int = 32, kv_cache_dtype=None,
                        w4_activations: str = DEFAULT_W4_ACTIVATIONS) -> "LLM":
        """Build from an in-memory checkpoint (``config``, ``dense``, ``quantized``)."""
        self = cls.__new__(cls)
        self.checkpoint_path = getattr(ckpt, "path", None)
        self._setup(ckpt, dtype, kernels, device, max_seq_len, threads, max_batch_size, tokenizer, {},
                    kv_cache_dtype, w4_activations)
        return self

    def _setup(self, ckpt, dtype, kernels, device, max_seq_len, threads, max_batch_size,
               tokenizer, generation_config: dict, kv_cache_dtype=None,
               w4_activations: str = DEFAULT_W4_ACTIVATIONS) -> None:
        if kernels not in BACKENDS:
            raise ValueError(f"unknown kernels {kernels!r}; choose one of {BACKENDS}")
        if threads:
            torch.set_num_threads(int(threads))
        self.config = ckpt.config
        self.manifest = getattr(ckpt, "manifest", None)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.kernels = kernels
        self.model = build_model(ckpt, self.dtype, self.device, kernels, max_seq_len, w4_activations=w4_activations)
        # what the int4 layers run with (reports record it); None: the model has none
        has_int4 = any(isinstance(m, Int4Linear) for m in self.model.modules())
        self.w4_activations = w4_activations if has_int4 else None
        kv = self.dtype if kv_cache_dtype is None else resolve_dtype(kv_cache_dtype)
        if kv not in (self.dtype, torch.float16):
            raise ValueError(f"kv_cache_dtype must be the model dtype ({self.dtype}) or float16, got {kv}")
        self.runner = ModelRunner(self.model, kv)
        self.scheduler = Scheduler(max_batch_size)
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_ids(self.config, generation_config, tokenizer)
        self.bos_token_id = (getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None)
        if self.bos_token_id is None:
            self.bos_token_id = getattr(self.config, "bos_token_id", None)

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Seq[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; cannot decode")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            if self.bos_token_id is None:
                raise ValueError("empty prompt and the model has no BOS token")
            ids = [self.bos_token_id]
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate "
                             f"(max_seq_len={self.max_seq_len})")
        return text, ids

    def _sequences(self, prompts, params) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            text, ids = self._prompt_ids(prompt)
            seqs.append(Sequence(i, text, ids, p, self.eos_token_ids, self.tokenizer))
        return seqs

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs in prompt order."""
        seqs = self._sequences(prompts, params)
        outputs: list[RequestOutput | None] = [None] * len(seqs)
        batches = self.scheduler.batches(seqs)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(seqs), desc="generate")
        for batch in batches:
            metrics: dict = {}
            for _ in self._run(batch, metrics):
                pass
            for s in batch:
                outputs[s.index] = s.output(metrics)
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        return outputs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text in pieces as tokens are produced."""
        (seq,) = self._sequences([prompt], params)
        if self.tokenizer is None:
            raise ValueError("stream needs a tokenizer; use generate with token ids")
        for _ in self._run([seq], {}):
            delta = seq.take_delta()
            if delta:
                yield delta
        delta = seq.take_delta()
        if delta:
            yield delta

    @torch.inference_mode()
    def _run(self, seqs: list[Sequence], metrics: dict):
        """Run one batch to completion, yielding after every step."""
        runner = self.runner
        longest = max(len(s.prompt_ids) for s in seqs)
        max_len = min(longest + max(s.params.max_tokens for s in seqs), self.max_seq_len)
        sampler = BatchSampler([s.params for s in seqs], self.device)
        t0 = time.perf_counter()
        logits = runner.prefill([s.prompt_ids for s in seqs], max_len)
        t1 = time.perf_counter()
        active, steps, greedy = list(seqs), 0, None
        while True:
            # all-greedy batches after the first token: the decode step's own argmax
            tokens = greedy if greedy is not None else sampler(logits).tolist()
            for s, tok in zip(active, tokens):
                s.append(tok)
                if runner.length + 1 >= self.max_seq_len:
                    s.finish("length")
            yield active
            keep = [i for i, s in enumerate(active) if not s.finished]
            if not keep:
                break
            if len(keep) < len(active):
                runner.keep(keep)
                sampler.keep(keep)
                active = [active[i] for i in keep]
            logits = runner.decode([s.output_ids[-1] for s in active], greedy=sampler.all_greedy)
            greedy = runner.greedy_tokens
            steps += 1
        t2 = time.perf_counter()
        metrics.update(batch_size=len(seqs), prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
                       prefill_s=t1 - t0, decode_steps=steps, decode_s=t2 - t1)

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def logits(self, input_ids, attention_mask=None) -> torch.Tensor:
        """Cache-free full forward: fp32 logits ``[B, T, V]``. ``attention_mask``
        (1 = token, 0 = padding, either side) lets rows of different lengths share a batch."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).view(input_ids.shape)
        return self.model.logits(self.runner.hidden_states(input_ids, mask)).cpu()

    def token_logprobs(self, input_ids, attention_mask=None) -> torch.Tensor:
        """``[B, T-1]``: log p(x_t | x_<t) for t = 1..T-1 (0 at padding)."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        return scoring.token_logprobs(self.runner, input_ids, attention_mask)

    def loglikelihood(self, requests: Seq[tuple], batch_size: int = 16) -> list[Loglikelihood]:
        """``(context, continuation)`` pairs, each text or token ids, to
        ``Loglikelihood(logprob, is_greedy)``: the summed log-probability of the
        continuation given the context, and whether greedy decoding yields it.
        Text contexts are encoded with special tokens (BOS), continuations without;
        an empty context is replaced by BOS."""
        pairs = []
        for ctx, cont in requests:
            ctx_ids = self.encode(ctx) if isinstance(ctx, str) else [int(t) for t in ctx]
            cont_ids = self.encode(cont, add_special_tokens=False) if isinstance(cont, str) else [int(t) for t in cont]
            if not ctx_ids and self.bos_token_id is not None:
                ctx_ids = [self.bos_token_id]
            pairs.append((ctx_ids, cont_ids))
        return scoring.loglikelihood(self.runner, pairs, batch_size)

    score = loglikelihood


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _load_tokenizer(path):
    if not path:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def _eos_ids(config, generation_config: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (generation_config.get("eos_token_id"), getattr(config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return {int(i) for i in ids}
