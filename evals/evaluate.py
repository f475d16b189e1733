"""Evaluate one checkpoint: perplexity, KL to base, lm-eval tasks, speed, size.

``evaluate_checkpoint(path, eval_config, base_logits_cache)`` returns one stage record for
:func:`evals.report.write_report`. ``base_logits_cache`` carries the base model's KL
reference between calls:

* ``None``: this checkpoint is its own reference (KL 0, agreement 1);
* a ``dict``: filled with the reference (key ``"reference"``) on the first call, used on
  later ones: pass the same dict for base, then each stage;
* a :class:`evals.kl.KLReference` (or the path of one saved with ``.save``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

import torch

from evals.backend import load_llm
from evals.kl import KLReference, build_kl_reference, kl_to_reference
from evals.perplexity import perplexity

# the held-out text shipped with the repository (the embedded model's evaluation set)
DEFAULT_EVAL_TEXT = str(Path(__file__).resolve().parent.parent / "data" / "pydoc" / "eval.txt")


@dataclass
class PerplexityConfig:
    file: str = DEFAULT_EVAL_TEXT
    seq_len: int = 512
    stride: int = 256
    max_tokens: int | None = None
    batch_size: int = 4


@dataclass
class KLConfig:
    file: str = DEFAULT_EVAL_TEXT
    windows: int = 8
    seq_len: int = 256
    top_k: int | None = None        # None: keep the base's whole distributions
    batch_size: int = 4


@dataclass
class SpeedConfig:
    prompt_len: int = 128
    new_tokens: int = 64
    repeats: int = 3
    warmup: int = 1


@dataclass
class EvalConfig:
    perplexity: PerplexityConfig | None = field(default_factory=PerplexityConfig)
    kl: KLConfig | None = field(default_factory=KLConfig)
    tasks: list[str] = field(default_factory=lambda: ["pydoc_ppl", "pydoc_cloze"])
    task_limit: int | float | None = None
    task_batch_size: int = 8
    speed: SpeedConfig | None = field(default_factory=SpeedConfig)
    threads: int | None = None
    dtype: str = "float32"
    kernels: str = "native"
    progress: bool = True

    def validate(self) -> None:
        if self.kernels not in ("native", "reference", "transformers"):
            raise ValueError(f"kernels must be one of ['native', 'reference', 'transformers'], got {self.kernels!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of ['float32', 'bfloat16', 'float16'], got {self.dtype!r}")

    @classmethod
    def from_dict(cls, d: dict | "EvalConfig" | None) -> "EvalConfig":
        """From a plain dict (recipe ``eval`` section); a section set to None/False is skipped."""
        if d is None:
            return cls()
        if isinstance(d, cls):
            return d
        if is_dataclass(d):
            d = asdict(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown eval setting(s) {sorted(unknown)}; known: {sorted(known)}")
        kw = dict(d)
        for key, sub in (("perplexity", PerplexityConfig), ("kl", KLConfig), ("speed", SpeedConfig)):
            if key in kw:
                kw[key] = _section(sub, key, kw[key])
        cfg = cls(**kw)
        cfg.validate()
        return cfg


def _section(cls, name, value):
    if value is None or value is False:
        return None
    if isinstance(value, cls):
        return value
    if value is True:
        return cls()
    known = {f.name for f in fields(cls)}
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"unknown eval.{name} setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return cls(**value)


def _reference(cache, llm, cfg: KLConfig, progress: bool) -> tuple[KLReference, bool]:
    """(reference, whether it was built from this model)."""
    if isinstance(cache, KLReference):
        return cache, False
    if isinstance(cache, (str, Path)):
        return KLReference.load(cache), False
    if isinstance(cache, dict) and isinstance(cache.get("reference"), KLReference):
        return cache["reference"], False
    ref = build_kl_reference(llm, cfg.file, windows=cfg.windows, seq_len=cfg.seq_len,
                             top_k=cfg.top_k, batch_size=cfg.batch_size, progress=progress)
    if isinstance(cache, dict):
        cache["reference"] = ref
    return ref, True


def size_fields(path: str | Path) -> dict:
    """Size on disk and bits per weight, as ``compress inspect`` reports them."""
    from compress.io.inspect import inspect_checkpoint

    info = inspect_checkpoint(path, verify=False)
    return {"size_bytes": info["weights_bytes"], "bits_per_weight": info["bits_per_weight"],
            "bits_per_weight_overall": info["bits_per_weight_overall"]}


def evaluate_checkpoint(path: str | Path, eval_config: dict | EvalConfig | None = None,
                        base_logits_cache=None, name: str | None = None, llm=None) -> dict:
    """One stage record (see :mod:`evals.report`) for the checkpoint at ``path``."""
    cfg = EvalConfig.from_dict(eval_config)
    path = Path(path)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    llm = llm or load_llm(path, dtype=cfg.dtype, kernels=cfg.kernels, threads=cfg.threads)
    rec: dict = {"name": name or path.name, "path": str(path), **size_fields(path)}
    t0 = time.perf_counter()
    if cfg.perplexity:
        pc = cfg.perplexity
        r = perplexity(llm, pc.file, seq_len=pc.seq_len, stride=pc.stride, max_tokens=pc.max_tokens,
                       batch_size=pc.batch_size, progress=cfg.progress)
        rec.update(perplexity=r.perplexity, perplexity_tokens=r.tokens, nll=r.nll)
    if cfg.kl:
        ref, own = _reference(base_logits_cache, llm, cfg.kl, cfg.progress)
        if own:
            rec.update(kl_to_base=0.0, top1_agreement=1.0, kl_tokens=ref.tokens)
        else:
            k = kl_to_reference(llm, ref, batch_size=cfg.kl.batch_size, progress=cfg.progress)
            rec.update(kl_to_base=k.kl, top1_agreement=k.top1_agreement, kl_tokens=k.tokens)
    rec["tasks"] = {}
    if cfg.tasks:
        from evals.harness import run_lm_eval
        rec["tasks"] = run_lm_eval(path, cfg.tasks, limit=cfg.task_limit,
                                   batch_size=cfg.task_batch_size, llm=llm)
    if cfg.speed:
        from evals.speed import measure_speed
        s = measure_speed(llm, prompt_len=cfg.speed.prompt_len, new_tokens=cfg.speed.new_tokens,
                          repeats=cfg.speed.repeats, warmup=cfg.speed.warmup)
        rec.update(prefill_tok_s=s.prefill_tok_s, decode_tok_s=s.decode_tok_s, speed=s.to_dict())
    rec["eval_seconds"] = time.perf_counter() - t0
    return rec
