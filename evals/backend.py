"""The model that evals drive: ``compress.runtime.LLM``, behind a few helpers.

Every eval talks to a model through four names only: ``.tokenizer`` (an HF tokenizer),
``.logits(input_ids [B, T]) -> [B, T, V]``, ``.generate(prompts, SamplingParams)`` and the
constructor ``(path, dtype=, kernels=, threads=)``. ``load_llm`` returns our runtime's
``LLM``; ``kernels="transformers"`` returns :class:`TransformersLLM`, the same four names
over ``transformers.AutoModelForCausalLM`` (a reference backend, and the fallback while
the runtime package is absent from a checkout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.w4_activations import DEFAULT_W4_ACTIVATIONS

log = logging.getLogger(__name__)

REFERENCE_KERNELS = "transformers"


@dataclass
class ReferenceSamplingParams:
    """Same fields as ``compress.runtime.SamplingParams`` (used with :class:`TransformersLLM`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class ReferenceOutput:
    text: str
    token_ids: list[int]


def _runtime():
    try:
        import compress.runtime as runtime
        return runtime if hasattr(runtime, "LLM") else None
    except ImportError as err:  # the runtime package is not in this checkout
        log.warning("compress.runtime unavailable (%s); evaluating with transformers", err)
        return None


def load_llm(path: str | Path, dtype: str = "float32", kernels: str = "native",
             threads: int | None = None, w4_activations: str = DEFAULT_W4_ACTIVATIONS):
    """Open a checkpoint for evaluation (our runtime unless ``kernels='transformers'``;
    ``w4_activations``: the runtime's activation precision for int4 layers)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    runtime = None if kernels == REFERENCE_KERNELS else _runtime()
    if runtime is None:
        return TransformersLLM(path, dtype=dtype, threads=threads)
    return runtime.LLM(str(path), dtype=dtype, kernels=kernels, threads=threads, w4_activations=w4_activations)


def sampling_params(llm, **kwargs):
    """A ``SamplingParams`` of the kind ``llm.generate`` expects (fields it lacks are dropped)."""
    import inspect
    if isinstance(llm, TransformersLLM):
        cls = ReferenceSamplingParams
    else:
        from compress.runtime import SamplingParams as cls
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


@torch.no_grad()
def logprobs(llm, input_ids: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax of ``llm.logits(input_ids)``: ``[B, T, V]``."""
    return torch.log_softmax(llm.logits(input_ids).float(), dim=-1)


def encode(llm, text: str, add_special_tokens: bool = True) -> torch.Tensor:
    """The whole text as one 1-D token stream (BOS first when the tokenizer adds one)."""
    ids = llm.tokenizer(text, add_special_tokens=add_special_tokens, verbose=False).input_ids
    return torch.tensor(ids, dtype=torch.long)


def read_text(file: str | Path | None = None, text: str | None = None) -> str:
    """``text`` if given, else the contents of ``file`` (UTF-8)."""
    if text is not None:
        return text
    if file is None:
        raise ValueError("give an evaluation text file or text")
    p = Path(file)
    if not p.is_file():
        raise FileNotFoundError(f"evaluation text not found: {p}")
    return p.read_text(encoding="utf-8")


def max_context(path: str | Path, tokenizer=None, default: int = 2048) -> int:
    """The model's context length, looked up the way lm-eval's HFLM does (config, tokenizer)."""
    import json
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        cfg = cfg.get("text_config") or cfg
        for key in ("n_positions", "max_position_embeddings", "n_ctx"):
            if cfg.get(key) is not None:
                return int(cfg[key])
    mml = getattr(tokenizer, "model_max_length", None)
    if mml is not None and mml < 1e29:
        return int(mml)
    return default


def model_context(llm, path: str | Path | None = None) -> int:
    """How many positions ``llm`` can take: the runtime's ``max_seq_len``, else the
    checkpoint's config (:func:`max_context`)."""
    n = getattr(llm, "max_seq_len", None)
    if isinstance(n, int) and n > 0:
        return n
    return max_context(path or getattr(llm, "path", "."), getattr(llm, "tokenizer", None))


def quiet_bitsandbytes_import(path: str | Path) -> None:
    """Import bitsandbytes with its warnings off when transformers will need it for the
    checkpoint at ``path`` (an LLM.int8 export): on a CPU its import logs that an optional
    4-bit kernel package is missing, which says nothing about an int8 model."""
    import json
    import sys
    cfg_file = Path(path) / "config.json"
    if "bitsandbytes" in sys.modules or not cfg_file.is_file():
        return
    quant = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "bitsandbytes":
        return
    bnb_log = logging.getLogger("bitsandbytes")
    level = bnb_log.level
    bnb_log.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass                 # transformers says what to install
    finally:
        bnb_log.setLevel(level)


class TransformersLLM:
    """``transformers`` behind the runtime's method names (reference backend)."""

    def __init__(self, path: str | Path, dtype: str = "float32", kernels: str = REFERENCE_KERNELS,
                 threads: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if threads:
            torch.set_num_threads(int(threads))
        quiet_bitsandbytes_import(path)
        self.path = Path(path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        self.model.eval()

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=torch.as_tensor(input_ids, dtype=torch.long)).logits

    @torch.no_grad()
    def generate(self, prompts, params: ReferenceSamplingParams | None = None):
        params = params or ReferenceSamplingParams()
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        outs = [self._generate_one(p, params) for p in ([prompts] if single else prompts)]
        return outs

    def _generate_one(self, prompt, params) -> ReferenceOutput:
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"]
        ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        out, past = [], None
        inp = torch.tensor([ids])
        eos = self.tokenizer.eos_token_id
        for _ in range(params.max_tokens):
            res = self.model(input_ids=inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = _sample(res.logits[0, -1].float(), params, gen)
            out.append(nxt)
            if nxt == eos and not params.ignore_eos:
                break
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if any(s and s in text for s in params.stop):
                break
            inp = torch.tensor([[nxt]])
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        for s in params.stop:
            if s and s in text:
                text = text[:text.index(s)]
        return ReferenceOutput(text=text, token_ids=out)


def _sample(logits: torch.Tensor, params, gen: torch.Generator) -> int:
    if not params.temperature or params.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k and params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        drop = torch.cumsum(sp, 0) - sp > params.top_p
        sp[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
