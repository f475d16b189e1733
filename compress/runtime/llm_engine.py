"""``LLMEngine``: requests in, one step at a time, outputs as they progress.

    engine.add_request("a", "Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...       # RequestOutput of each request that got a token

A step: the scheduler picks the rows and their token counts (decodes and prefill chunks
under a token budget, ``scheduler.py``), the model runner computes them into the paged
KV cache and returns the logits of rows whose next token is due, the sampler draws
those tokens, and each sequence appends its token, updates its text and checks its
stops. Finished requests give back their blocks at once. Not thread-safe: one thread
calls ``add_request`` / ``abort`` / ``step``.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from compress.runtime.block_manager import BlockManager
from compress.runtime.kv_cache import PagedKVCache, bytes_per_token, default_num_blocks, resolve_kv_cache_dtype
from compress.runtime.model_runner import ModelRunner
from compress.runtime.models.llama import LlamaFamilyModel
from compress.runtime.sampling import BatchSampler, SamplingParams, token_logprobs_topk
from compress.runtime.prefill_cap import PrefillCap
from compress.runtime.step_log import StepLog
from compress.runtime.scheduler import Scheduler
from compress.runtime.sequence import RequestOutput, Sequence, TokenLogprob

log = logging.getLogger(__name__)


def _native_decode(model: LlamaFamilyModel):
    """The model's native one-call decode step, or None (no native module, or the model
    has a form it does not take)."""
    try:
        from compress.runtime.native_decode import build_native_decode
    except ImportError:
        return None
    return build_native_decode(model)


class LLMEngine:
    """``kv_cache_dtype``: the cache's element type (float32 / bfloat16 / float16, or int8
    with a scale a row, ``compress/ops/kv_int8.py``; None: the model's dtype). ``kv_cache_tokens``: positions the paged cache holds in all
    (rounded up to whole blocks); default: ``max_num_seqs`` rows of ``max_seq_len``,
    capped at half the memory (``kv_cache.default_num_blocks``). ``native_decode``:
    run decode-only steps through the native plan where the model allows it.
    ``max_prefill_tokens_with_decodes``: the prompt tokens a step that also decodes may
    take (``scheduler.py``); ``max_itl_ratio``: instead of a fixed cap, one sized from the
    measured step times so that a step with prompt chunks takes about that many times a
    decode-only step (``prefill_cap.py``; with chunked prefill only). ``cuda_graphs``: on a GPU, decode steps replay CUDA graphs
    captured at start (``cuda_graphs.py``); off, they launch every kernel."""

    def __init__(self, model: LlamaFamilyModel, tokenizer=None, eos_token_ids=(), bos_token_id: int | None = None,
                 *, kv_cache_dtype=None, block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, native_decode: bool = True, speculative=None,
                 max_prefill_tokens_with_decodes: int | None = None, cuda_graphs: bool = True,
                 max_itl_ratio: float | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.bos_token_id = bos_token_id
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model.dtype)
        n_layers = len(model.layers)
        if kv_cache_tokens is None:
            num_blocks = default_num_blocks(max_num_seqs, model.max_seq_len, block_size,
                                            bytes_per_token(n_layers, model.n_kv_heads, model.head_dim, kv_dtype),
                                            model.device)
        else:
            if kv_cache_tokens < 1:
                raise ValueError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens}")
            num_blocks = -(-int(kv_cache_tokens) // block_size)
        self.kv_cache = PagedKVCache(n_layers, num_blocks, model.n_kv_heads, block_size, model.head_dim,
                                     kv_dtype, model.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.prefill_cap = None
        if max_itl_ratio is not None:
            if max_prefill_tokens_with_decodes is not None:
                raise ValueError("give max_itl_ratio (a cap sized from step times) or max_prefill_tokens_with_decodes "
                                 "(a fixed cap), not both")
            if not enable_chunked_prefill:
                raise ValueError("max_itl_ratio needs chunked prefill (enable_chunked_prefill=True)")
            self.prefill_cap = PrefillCap(max_itl_ratio, max_num_batched_tokens)
            max_prefill_tokens_with_decodes = self.prefill_cap.cap
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                                   max_prefill_tokens_with_decodes)
        graphs = None
        if (cuda_graphs and model.device.type == "cuda"   # captured now, while no sequence holds a block
                and all(layer.attn.backend == "native" for layer in model.layers)):  # the reference ops sync
            from compress.runtime.cuda_graphs import DecodeGraphs
            try:
                graphs = DecodeGraphs(model, self.kv_cache, max_num_seqs)
            except RuntimeError as exc:   # an op that syncs with the host cannot be captured
                log.warning("CUDA graph capture failed (%s); decode steps launch their kernels instead",
                            str(exc).splitlines()[0][:200])
                torch.cuda.synchronize()
        self.runner = ModelRunner(model, self.kv_cache, _native_decode(model) if native_decode else None, graphs)
        self.requests: dict[str, Sequence] = {}
        # the thread that steps this engine for a server (compress serve's engine loop)
        # while it runs: the engine is not thread-safe, so other threads are refused
        self.owner_thread: threading.Thread | None = None
        self.tokens_generated = 0
        self.tokens_prefilled = 0
        self.tokens_decoded = 0
        self.steps = 0
        self._sampler_key: tuple = ()
        self._sampler: BatchSampler | None = None
        self.speculative = speculative   # a SpeculativeDecoder (speculative/), or None
        self.step_log: StepLog | None = None   # set to record every plain step (step_log.py)

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt (text, or token ids); ValueError when
        it cannot be run."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass token ids instead of text")
            ids, text = list(self.tokenizer(prompt)["input_ids"]), prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            if self.bos_token_id is None:
                raise ValueError("empty prompt and the model has no BOS token")
            ids = [self.bos_token_id]
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate "
                             f"(max_seq_len={self.max_seq_len})")
        vocab = self.model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if self.block_manager.blocks_for(len(ids)) > self.block_manager.num_blocks:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the KV cache of {self.kv_cache.num_tokens} "
                             f"positions (kv_cache_tokens)")
        return text, ids

    def check_owner(self, what: str) -> None:
        """A RuntimeError naming ``what`` when another thread than the one running this
        engine for a server (``owner_thread``) would change it: it would race that
        thread's steps."""
        owner = self.owner_thread
        if owner is not None and owner.is_alive() and owner is not threading.current_thread():
            raise RuntimeError(f"{what}: this LLM's engine is run by the thread {owner.name!r} (a server's engine "
                               "loop), and the engine is not thread-safe; use a second LLM for direct calls, or "
                               "send requests to the server")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request (text or token ids). ValueError: duplicate id, a prompt that
        is empty without a BOS token, leaves no room to generate, or does not fit the
        KV cache; RuntimeError: a server's engine thread owns the engine (check_owner)."""
        self.check_owner("LLMEngine.add_request")
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids = self.prompt_ids(prompt)
        seq = Sequence(request_id, text, ids, params or SamplingParams(), self.eos_token_ids, self.tokenizer,
                       arrival_time)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops a request and frees its blocks now; False when it is not in the engine."""
        seq = self.requests.pop(str(request_id), None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish("abort")
        if self.speculative is not None:
            self.speculative.release(seq.request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forgets the cached prefixes no request holds (timings of repeated prompts)."""
        self.check_owner("LLMEngine.reset_prefix_cache")
        return self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ a step
    def step(self) -> list[RequestOutput]:
        """One iteration; the outputs of the requests that got a token or finished."""
        batch = self.scheduler.schedule(decode_only=self.prefill_cap is not None
                                        and self.prefill_cap.wants_decode_only())
        outputs = [self._finished(seq) for seq in batch.finished]
        if not batch:
            return outputs
        self.steps += 1
        if self.speculative is not None:
            spec_outputs = self.speculative.step(self, batch.seqs, batch.num_new_tokens)
            if spec_outputs is not None:
                return outputs + spec_outputs
        greedy = all(s.plain_greedy for s in batch.seqs)
        t0 = time.perf_counter()
        out = self.runner.run(batch.seqs, batch.num_new_tokens, greedy=greedy)
        seconds = time.perf_counter() - t0
        prompt_tokens = decode_rows = 0
        register = self.block_manager.register_full_blocks if self.block_manager.enable_prefix_caching else None
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if len(seq.token_ids) - seq.num_computed_tokens > 1 or not seq.output_ids:  # prompt (or recompute)
                prompt_tokens += n
            else:
                decode_rows += 1
            seq.num_computed_tokens += n
            if register is not None:
                register(seq)
        self.tokens_prefilled += prompt_tokens
        if self.step_log is not None:
            self.step_log.add(time.time(), seconds, decode_rows, prompt_tokens)
        self.tokens_decoded += decode_rows
        if self.prefill_cap is not None:
            self.scheduler.max_prefill_tokens_with_decodes = self.prefill_cap.observe(seconds, decode_rows,
                                                                                      prompt_tokens)
        if not out.sampled:
            return outputs
        rows = [out.seqs[r] for r in out.sampled]
        return outputs + self.emit(rows, out.logits, out.greedy_tokens)

    def emit(self, rows: list[Sequence], logits: torch.Tensor, tokens: list[int] | None = None) -> list[RequestOutput]:
        """Each row's next token from its ``logits`` (``tokens``: already chosen
        greedily), appended with its logprobs; the rows' outputs."""
        outputs = []
        tokens = tokens if tokens is not None else self._sample(rows, logits)
        logprobs = self.chosen_logprobs(rows, logits, tokens)
        for seq, token, lp in zip(rows, tokens, logprobs):
            self.append_token(seq, token, lp)
            outputs.append(self._finished(seq) if seq.finished else seq.output())
        return outputs

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """Appends a generated token (stops, ``max_tokens`` and the model's length checked);
        whether ``seq`` has now finished."""
        seq.append(token, logprob)
        self.tokens_generated += 1
        if len(seq.token_ids) >= self.model.max_seq_len:
            seq.finish("length")
        return seq.finish_reason is not None

    def _finished(self, seq: Sequence) -> RequestOutput:
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        if self.speculative is not None:
            self.speculative.release(seq.request_id)
        return seq.output()

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> list[int]:
        key = tuple(s.request_id for s in rows)
        if key != self._sampler_key or self._sampler is None:
            self._sampler = BatchSampler([s.params for s in rows], [s.generator for s in rows], logits.device)
            self._sampler_key = key
        histories = [(s.prompt_ids, s.output_ids) for s in rows] if self._sampler.needs_history else None
        return self._sampler(logits, histories).tolist()

    @staticmethod
    def chosen_logprobs(rows: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
        """Row r's ``tokens[r]`` scored under ``logits[r]`` for the rows whose request asks
        for logprobs (None for the others); a sequence may fill several rows."""
        want = [r for r, s in enumerate(rows) if s.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(rows)
        if not want:
            return out
        picked = logits if len(want) == len(rows) else logits[want]
        found = token_logprobs_topk(picked, [tokens[r] for r in want], [int(rows[r].params.logprobs) for r in want])
        for r, (lp, top) in zip(want, found):
            out[r] = TokenLogprob(tokens[r], lp, top)
        return out

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return {"waiting": len(sched.waiting), "running": len(sched.running),
                "kv_blocks_used": bm.num_used_blocks, "kv_blocks_total": bm.num_blocks,
                "kv_blocks_cached_free": len(bm.free_cached), "block_size": bm.block_size,
                "kv_tokens_computed": sum(s.num_computed_tokens for s in sched.running),
                # KV slots the running sequences hold past their computed positions: the
                # free tail of each one's last block (paged: under one block a sequence)
                "kv_slots_reserved_unused": sum(len(s.block_table) * bm.block_size - s.num_computed_tokens
                                                for s in sched.running),
                "num_preemptions": sched.num_preemptions,
                "prefix_cache_hits": bm.hit_tokens, "prefix_cache_queries": bm.query_tokens,
                "tokens_generated": self.tokens_generated, "tokens_prefilled": self.tokens_prefilled,
                "tokens_decoded": self.tokens_decoded, "steps": self.steps,
                "native_decode": self.runner.native is not None,
                "cuda_graph_replays": 0 if self.runner.graphs is None else self.runner.graphs.replays,
                **({} if self.speculative is None else self.speculative.stats_dict())}
