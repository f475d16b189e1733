"""lm-eval model ``compress``: loglikelihood, loglikelihood_rolling and generate_until over
our runtime.

Token boundaries follow lm-eval's ``HFLM`` so that an unquantized checkpoint scores the
same as ``--model hf``: a context/continuation pair is encoded whole and split at the
length of the encoded context (trailing context spaces move to the continuation); the
tokenizer adds BOS as it is configured to (``add_bos_token=`` overrides); an empty context
is replaced by ``prefix_token_id`` (BOS, else EOS); rolling log-likelihoods use lm-eval's
disjoint windows of the model's context length, prefixed by ``prefix_token_id``.

A request longer than the model's context is never an error: its context is cut from the
left as far as needed (as lm-eval's HF model does); a continuation that alone is longer
than the context is scored on its last ``max_length`` tokens (each given all the tokens
before it that fit), and such requests are counted in one warning per call. Likewise a
``max_gen_toks`` that leaves no room for a prompt is cut to half the context (one warning).

Usage::

    import evals.lm_eval_adapter  # registers "compress"
    lm_eval.simple_evaluate(model="compress", model_args="pretrained=PATH,batch_size=8", ...)
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (Collator, handle_stop_sequences, has_bos_prefix,
                                  normalize_gen_kwargs, postprocess_generated_text)
from tqdm import tqdm

from evals.backend import load_llm, model_context, sampling_params

log = logging.getLogger(__name__)


def _bool_or_none(v):
    if v is None or isinstance(v, bool):
        return v
    return str(v).lower() in ("1", "true", "yes")


@register_model("compress")
class CompressLM(TemplateLM):
    """A compress checkpoint (packed or unquantized HF directory) run by ``compress.runtime``."""

    def __init__(self, pretrained: str, dtype: str = "float32", kernels: str = "native",
                 batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, threads: int | None = None,
                 llm=None, **kwargs) -> None:
        super().__init__()
        self.pretrained = str(pretrained)
        self.llm = llm if llm is not None else load_llm(
            pretrained, dtype=dtype, kernels=kernels, threads=int(threads) if threads else None)
        self.tokenizer = self.llm.tokenizer
        # "auto" has no meaning on CPU here: fall back to a fixed batch
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        context = model_context(self.llm, pretrained)
        self._max_length = min(int(max_length), context) if max_length else context
        if max_length and int(max_length) > context:
            log.warning("max_length %s is longer than the model's context; using %d", max_length, context)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _bool_or_none(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """``pretrained=PATH,dtype=float32,kernels=native,batch_size=8,threads=2,...``"""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string),
                                       additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # of lm-eval's extra settings only batch_size applies (device is the runtime's choice)
        extra = {k: v for k, v in (additional_config or {}).items()
                 if k == "batch_size" and v is not None}
        return cls(**{**arg_dict, **extra})

    # ----------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def _special(self, add_special_tokens: bool | None) -> dict:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        if self.add_bos_token is not None:
            return {"add_special_tokens": self.add_bos_token}
        return {}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        special = self._special(add_special_tokens)
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False  # the text already carries its BOS
        # whole documents are longer than the model's context on purpose (windowed below):
        # verbose=False keeps the tokenizer's "sequence length is longer" warning off
        ids = self.tokenizer.encode(string, verbose=False, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- scoring
    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """``(context, continuation)`` with a continuation of at most ``max_length`` tokens
        (an over-long one keeps its last tokens; the rest joins the context) and a
        non-empty context."""
        ctx = list(ctx) or [self.prefix_token_id]
        if len(cont) > self.max_length:
            ctx, cont = ctx + list(cont[:-self.max_length]), list(cont[-self.max_length:])
        return ctx, list(cont)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` of each continuation given its context (token lists).
        An empty continuation scores ``(0.0, True)``."""
        requests = list(requests)
        scored = [(key, *self._fit(ctx, cont)) for key, ctx, cont in requests if cont]
        cut = sum(len(cont) > self.max_length for _, _, cont in requests)
        if cut:
            log.warning("%d of %d requests have a continuation longer than the model's context "
                        "(%d tokens): scored on its last %d tokens", cut, len(requests),
                        self.max_length, self.max_length)
        coll = Collator(scored, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        res = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="compress loglikelihood")
        bar.update(len(requests) - len(scored))
        for chunk in coll.get_batched(n=self.batch_size):
            inps, conts = [], []
            for _, ctx, cont in chunk:
                # the model sees context + continuation minus its last token, left-truncated
                inps.append((ctx + cont)[-(self.max_length + 1):][:-1])
                conts.append(cont)
            width = max(map(len, inps))
            batch = torch.zeros(len(inps), width, dtype=torch.long)  # right padding (causal)
            for row, inp in enumerate(inps):
                batch[row, :len(inp)] = torch.tensor(inp)
            lp = F.log_softmax(self.llm.logits(batch).float(), dim=-1)
            for row, (inp, cont) in enumerate(zip(inps, conts)):
                sl = lp[row, len(inp) - len(cont):len(inp)]
                tgt = torch.tensor(cont)
                greedy = bool((sl.argmax(-1) == tgt).all())
                res.append((float(sl.gather(-1, tgt[:, None]).sum()), greedy))
                bar.update(1)
        bar.close()
        scores = iter(coll.get_original(res))
        return [next(scores) if cont else (0.0, True) for _, _, cont in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm,
                                            desc="compress rolling windows")):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owners, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ----------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out, shortened = [], 0
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm,
                                        desc="compress generate_until"):
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_gen = int(kw.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                shortened += 1
                max_gen = max(1, self.max_length // 2)
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen)
            params = sampling_params(
                self.llm, max_tokens=max_gen,
                temperature=float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0,
                top_k=int(kw.get("top_k") or 0), top_p=float(kw.get("top_p") or 1.0),
                seed=int(kw.get("seed") or 0), stop=list(until))
            result = self.llm.generate([ids], params)[0]
            text = self.tok_decode(result.token_ids)
            text = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        if shortened:
            log.warning("%d of %d requests asked for at least the model's context (%d tokens) of new "
                        "tokens: generated %d", shortened, len(requests), self.max_length,
                        max(1, self.max_length // 2))
        return out

    def get_model_info(self) -> dict:
        return {"model_path": self.pretrained, "backend": type(self.llm).__name__}
