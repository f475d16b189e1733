"""``LLM``: the vLLM-shaped entry point of the compress runtime.

    llm = LLM("out/quickstart/int4")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    for delta in llm.stream("Hello", SamplingParams(max_tokens=32)): print(delta, end="")
    llm.loglikelihood([(context_ids, continuation_ids)])   # evals
    llm.engine.add_request("r1", "Hello", SamplingParams()); llm.engine.step()   # serving

A thin facade over ``LLMEngine`` (``llm_engine.py``): ``generate`` queues every prompt
and steps the engine until they are done (continuous batching); scoring runs cache-free
forwards of padded batches (``scoring.py``).
"""
from __future__ import annotations

import json
import itertools
from pathlib import Path
from typing import Iterator, Sequence as Seq

import torch

from compress.errors import UserError
from compress.ops import BACKENDS
from compress.runtime import scoring
from compress.runtime.layers import Int4Linear
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS
from compress.runtime.loading import open_checkpoint
from compress.dtypes import resolve_dtype
from compress.runtime.kv_cache import resolve_kv_cache_dtype
from compress.runtime.llm_engine import LLMEngine
from compress.runtime.models.llama import build_model
from compress.runtime.sampling import SamplingParams
from compress.runtime.sequence import RequestOutput
from compress.runtime.speculative import ModelDrafter, NgramDrafter, SpeculativeConfig, SpeculativeDecoder
from compress.runtime.speculative.model_drafter import check_draft_vocab
from compress.runtime.scoring import Loglikelihood


class LLM:
    """Loads a checkpoint (exported by compress, or a plain HF directory) and serves it.

    ``kernels``: 'native' (compiled kernels where available, else the reference) or
    'reference' (the pure-PyTorch ops). ``max_seq_len`` defaults to the config's
    ``max_position_embeddings``. ``threads`` sets torch's intra-op threads.
    ``kv_cache_dtype``: the KV cache's element type, ``None`` for the model's ``dtype``
    (exact), ``"float16"`` or ``"bfloat16"`` (half the cache bytes a decode step reads;
    keys and values are rounded when stored), ``"int8"`` (CPU: a quarter of float32's
    bytes and a scale a row, ``compress/ops/kv_int8.py``), or ``"float32"``.
    ``w4_activations``: how int4 (w4a16) layers treat their activations. ``"float"`` (the
    default): as the scheme and its compressed-tensors export say, activations in the
    model's dtype against each weight dequantized in fp32, so the logits are what
    transformers computes on the same export (to fp32 rounding). ``"int8"``: the CPU fast
    path, activations quantized to int8 per block of 32 along K as llama.cpp does
    (faster int4 kernels; logits ~0.4% off). The attribute ``w4_activations`` says what
    the model's int4 layers run with, ``None`` when it has none.

    Serving (``LLMEngine``): ``max_batch_size`` running sequences at most;
    ``max_num_batched_tokens`` tokens per step (decodes plus prefill chunks);
    ``enable_chunked_prefill`` (a long prompt is prefilled over several steps while
    decodes go on; off: whole prompts); ``enable_prefix_caching`` (full KV blocks of
    equal prefixes are shared and not recomputed); ``block_size`` positions per KV
    block; ``kv_cache_tokens`` positions in the paged cache (default: ``max_batch_size``
    rows of ``max_seq_len``, at most half the memory; on CPU it is committed only as it
    is written). ``native_decode``: decode-only steps through the native one-call plan
    where the model allows it (``native_decode.py``); off, every step runs the modules.
    ``max_prefill_tokens_with_decodes``: the prompt tokens a step that also decodes may
    take; ``max_itl_ratio``: that cap sized from measured step times instead, so a step
    with prompt chunks takes about that many times a decode-only step (``prefill_cap.py``).
    ``cuda_graphs``: on a GPU (``device="cuda"``), decode steps replay CUDA graphs captured
    at load, one per batch bucket (``cuda_graphs.py``); off, each step launches its kernels.

    ``speculative``: speculative decoding (``runtime/speculative/``), lossless: a dict
    ``{"model": DRAFT, "num_speculative_tokens": k}`` (a draft checkpoint with the
    target's tokenizer, loaded with the same dtype and kernels) or ``{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": 4}`` (prompt lookup, no model);
    a path or ``"ngram"`` alone take k = 3. Decode-only steps then draft up to k tokens per
    sequence, verify them in one pass of this model and keep what rejection sampling
    accepts; ``engine.stats()`` gives the acceptance figures."""

    def __init__(self, path, dtype="float32", kernels: str = "native", device: str = "cpu",
                 max_seq_len: int | None = None, threads: int | None = None, max_batch_size: int = 32,
                 kv_cache_dtype=None, w4_activations: str = DEFAULT_W4_ACTIVATIONS, block_size: int = 16,
                 kv_cache_tokens: int | None = None, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True, native_decode: bool = True,
                 speculative=None, max_prefill_tokens_with_decodes: int | None = None, cuda_graphs: bool = True,
                 max_itl_ratio: float | None = None):
        engine_args = dict(block_size=block_size, kv_cache_tokens=kv_cache_tokens, cuda_graphs=cuda_graphs,
                           max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
                           enable_prefix_caching=enable_prefix_caching, native_decode=native_decode,
                           speculative=speculative, max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                           max_itl_ratio=max_itl_ratio)
        ckpt = open_checkpoint(path)
        directory = Path(getattr(ckpt, "path", None) or path)
        self.checkpoint_path = directory
        self._setup(ckpt, dtype, kernels, device, max_seq_len, threads, max_batch_size,
                    tokenizer=_load_tokenizer(ckpt.tokenizer_path),
                    generation_config=_read_json(directory / "generation_config.json"),
                    kv_cache_dtype=kv_cache_dtype, w4_activations=w4_activations, engine_args=engine_args)

    @classmethod
    def from_checkpoint(cls, ckpt, tokenizer=None, dtype="float32", kernels: str = "native",
                        device: str = "cpu", max_seq_len: int | None = None, threads: int | None = None,
                        max_batch_size: int = 32, kv_cache_dtype=None,
                        w4_activations: str = DEFAULT_W4_ACTIVATIONS, **engine_args) -> "LLM":
        """Build from an in-memory checkpoint (``config``, ``dense``, ``quantized``);
        ``engine_args``: the serving keywords of ``LLM()``."""
        self = cls.__new__(cls)
        self.checkpoint_path = getattr(ckpt, "path", None)
        self._setup(ckpt, dtype, kernels, device, max_seq_len, threads, max_batch_size, tokenizer, {},
                    kv_cache_dtype, w4_activations, engine_args)
        return self

    def _setup(self, ckpt, dtype, kernels, device, max_seq_len, threads, max_batch_size,
               tokenizer, generation_config: dict, kv_cache_dtype=None,
               w4_activations: str = DEFAULT_W4_ACTIVATIONS, engine_args: dict | None = None) -> None:
        if kernels not in BACKENDS:
            raise ValueError(f"unknown kernels {kernels!r}; choose one of {BACKENDS}")
        engine_args = dict(engine_args or {})
        speculative = SpeculativeConfig.parse(engine_args.pop("speculative", None))
        unknown = sorted(set(engine_args) - ENGINE_ARGS)
        if unknown:
            raise TypeError(f"LLM got unknown arguments {unknown}; engine arguments: {sorted(ENGINE_ARGS)}")
        if threads:
            torch.set_num_threads(int(threads))
        self.config = ckpt.config
        self.manifest = getattr(ckpt, "manifest", None)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"device={str(device)!r}: torch {torch.__version__} sees no CUDA device")
        self.kernels = kernels
        kv = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.model = build_model(ckpt, self.dtype, self.device, kernels, max_seq_len, w4_activations=w4_activations)
        # what the int4 layers run with (reports record it); None: the model has none
        has_int4 = any(isinstance(m, Int4Linear) for m in self.model.modules())
        self.w4_activations = w4_activations if has_int4 else None
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_ids(self.config, generation_config, tokenizer)
        self.generation_config = dict(generation_config or {})
        self.bos_token_id = (getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None)
        if self.bos_token_id is None:
            self.bos_token_id = getattr(self.config, "bos_token_id", None)
        # the engine shares the eos set: LLM.eos_token_ids changes what stops its requests
        self.engine = LLMEngine(self.model, tokenizer, (), self.bos_token_id, kv_cache_dtype=kv,
                                max_num_seqs=max_batch_size, **engine_args)
        self.engine.eos_token_ids = self.eos_token_ids
        self.runner = self.engine.runner
        self.speculative = speculative
        if speculative is not None:
            self.engine.speculative = SpeculativeDecoder(self._drafter(speculative, w4_activations, engine_args),
                                                         speculative.num_speculative_tokens)
        self._ids = itertools.count()

    def _drafter(self, spec: SpeculativeConfig, w4_activations: str, engine_args: dict):
        """The drafter ``spec`` names: prompt lookup, or a draft model loaded like the
        target (same dtype, kernels, device) with its own paged cache of the same size."""
        if spec.method == "ngram":
            return NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        draft_ckpt = open_checkpoint(spec.model)
        draft_vocab = getattr(draft_ckpt.config, "vocab_size", None)
        if draft_vocab is not None:   # before the tokenizers are compared: the plainer message first
            check_draft_vocab(draft_vocab, self.model.vocab_size, spec.model)
        _check_draft_tokenizer(self.tokenizer, getattr(draft_ckpt, "tokenizer_path", None), spec.model)
        model = build_model(draft_ckpt, self.dtype, self.device, self.kernels, self.model.max_seq_len,
                            w4_activations=w4_activations)
        return ModelDrafter.for_target(model, self.engine, engine_args.get("native_decode", True), spec.model)

    @property
    def draft_model(self):
        """The draft model of speculative decoding, or None (none, or prompt lookup)."""
        spec = self.engine.speculative
        return getattr(spec.drafter, "model", None) if spec is not None else None

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.engine.kv_cache.dtype

    def reset_prefix_cache(self) -> int:
        """Forgets the cached prefixes no request holds, so a repeated prompt is computed
        again (speed measurements); returns how many KV blocks were forgotten."""
        return self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Seq[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; cannot decode")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def default_sampling_fields(self) -> dict:
        """What ``generate`` / ``stream`` use when given no SamplingParams, over the
        SamplingParams defaults: the checkpoint's generation_config.json sampling fields
        (:func:`sampling_defaults`)."""
        return sampling_defaults(self.generation_config)

    # ------------------------------------------------------------------ generation
    def _add(self, prompts, params) -> list[str]:
        """Queues every prompt (text, token ids, or a list of them); the request ids."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams(**self.default_sampling_fields())
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, plist):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return ids

    def _steps(self):
        """Steps the engine; yields each step's outputs."""
        while self.engine.has_unfinished():
            yield self.engine.step()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs in prompt order. Steps the
        engine until they are done (other requests in the engine advance too; their
        outputs are not returned here)."""
        self.engine.check_owner("LLM.generate")
        ids = self._add(prompts, params)
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        try:
            with torch.inference_mode():
                for outputs in self._steps():
                    for out in outputs:
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                    if len(done) == len(ids):
                        break
        finally:
            for rid in wanted - set(done):
                self.engine.abort(rid)
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text in pieces as tokens are produced."""
        if self.tokenizer is None:
            raise ValueError("stream needs a tokenizer; use generate with token ids")
        self.engine.check_owner("LLM.stream")
        (rid,) = self._add([prompt], params)
        seq = self.engine.requests[rid]
        try:
            with torch.inference_mode():
                for _ in self._steps():
                    delta = seq.take_delta()
                    if delta:
                        yield delta
                    if seq.finished:
                        break
            delta = seq.take_delta()
            if delta:
                yield delta
        finally:
            self.engine.abort(rid)

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def logits(self, input_ids, attention_mask=None) -> torch.Tensor:
        """Cache-free full forward: fp32 logits ``[B, T, V]``. ``attention_mask``
        (1 = token, 0 = padding, either side) lets rows of different lengths share a batch."""
        self.engine.check_owner("LLM.logits")
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).view(input_ids.shape)
        return self.model.logits(self.runner.hidden_states(input_ids, mask)).cpu()

    def token_logprobs(self, input_ids, attention_mask=None) -> torch.Tensor:
        """``[B, T-1]``: log p(x_t | x_<t) for t = 1..T-1 (0 at padding)."""
        self.engine.check_owner("LLM.token_logprobs")
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        return scoring.token_logprobs(self.runner, input_ids, attention_mask)

    def loglikelihood(self, requests: Seq[tuple], batch_size: int = 16) -> list[Loglikelihood]:
        """``(context, continuation)`` pairs, each text or token ids, to
        ``Loglikelihood(logprob, is_greedy)``: the summed log-probability of the
        continuation given the context, and whether greedy decoding yields it.
        Text contexts are encoded with special tokens (BOS), continuations without;
        an empty context is replaced by BOS. Like generate, refused while a server's
        engine thread runs this LLM (that thread scores the server's echo requests on the
        same model runner)."""
        self.engine.check_owner("LLM.loglikelihood")
        pairs = []
        for ctx, cont in requests:
            ctx_ids = self.encode(ctx) if isinstance(ctx, str) else [int(t) for t in ctx]
            cont_ids = self.encode(cont, add_special_tokens=False) if isinstance(cont, str) else [int(t) for t in cont]
            if not ctx_ids and self.bos_token_id is not None:
                ctx_ids = [self.bos_token_id]
            vocab = self.model.vocab_size
            for what, ids in (("context", ctx_ids), ("continuation", cont_ids)):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ValueError(f"loglikelihood request {len(pairs)}: {what} token id {bad} is outside the "
                                     f"vocabulary (0..{vocab - 1})")
            pairs.append((ctx_ids, cont_ids))
        return scoring.loglikelihood(self.runner, pairs, batch_size)

    score = loglikelihood


ENGINE_ARGS = {"block_size", "kv_cache_tokens", "max_num_batched_tokens", "enable_chunked_prefill",
               "enable_prefix_caching", "native_decode",
               "max_prefill_tokens_with_decodes", "cuda_graphs", "max_itl_ratio"}   # and speculative (taken apart before the engine)


# generation_config.json fields that become sampling defaults (vLLM's choice), with the
# values each accepts
GENERATION_DEFAULTS = {"temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1,
                       "top_k": lambda v: v >= -1 and float(v).is_integer(), "repetition_penalty": lambda v: v > 0}


def sampling_defaults(generation_config: dict) -> dict:
    """The sampling fields a checkpoint's generation_config.json sets (``temperature``,
    ``top_p``, ``top_k``, ``repetition_penalty``): what a request or ``generate`` call that
    does not name them gets, as vLLM does. A value of the wrong type or out of range is left out."""
    out = {}
    for name, ok in GENERATION_DEFAULTS.items():
        v = generation_config.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and ok(v):
            out[name] = max(0, int(v)) if name == "top_k" else float(v)
    return out


def _check_draft_tokenizer(target_tokenizer, draft_tokenizer_path, name) -> None:
    """A draft whose tokenizer maps tokens to other ids than the target's is refused: its
    tokens would still be verified (the output stays the target's), but almost none
    accepted. Where either side has no tokenizer, the vocabulary sizes are what is checked."""
    if target_tokenizer is None or not draft_tokenizer_path:
        return
    draft_tokenizer = _load_tokenizer(draft_tokenizer_path)
    if draft_tokenizer is None:
        return
    theirs, ours = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(t for t in set(theirs) | set(ours) if theirs.get(t) != ours.get(t))
        raise ValueError(f"speculative: the draft {name}'s tokenizer is not the target's ({len(differ)} tokens differ, "
                         f"e.g. {differ[0]!r}: {theirs.get(differ[0])} against {ours.get(differ[0])}); a draft must "
                         "share the target's tokenizer")


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
