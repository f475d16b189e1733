"""The ``eval`` section of a recipe: what to measure on every stage, and how.

Settings that depend on the model's context are ``None`` by default and are sized to
the loaded model by :meth:`EvalConfig.for_context`:

* ``perplexity.seq_len``: ``min(512, context)``; ``perplexity.stride``: ``seq_len // 2``;
* ``kl.seq_len``: ``min(256, context)``;
* ``speed.new_tokens``: ``min(64, context // 2)``; ``speed.prompt_len``:
  ``min(128, context - new_tokens)`` (prompt and generated tokens share the context).

``speculative`` (off unless given): stages of the recipe measured as drafts of the base
(``evals/speculative.py``); its ``prompt_len + new_tokens`` must fit the context. That
the drafts name stages of the recipe is checked where the stages are known
(``compress/recipe.py``).

An explicit value the context cannot take is a :class:`compress.config.ConfigError`
naming its key: :func:`check_eval_against_context` runs in ``compress run --dry-run``
(from the model's ``config.json``), before any work is done.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

from compress.config import ConfigError, check
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS, W4_ACTIVATIONS

# the held-out text shipped with the repository (the embedded model's evaluation set)
DEFAULT_EVAL_TEXT = str(Path(__file__).resolve().parent.parent / "data" / "pydoc" / "eval.txt")

PERPLEXITY_SEQ_LEN = 512
KL_SEQ_LEN = 256
SPEED_PROMPT_LEN = 128
SPEED_NEW_TOKENS = 64

KERNELS = ("native", "reference", "transformers")
EVAL_DTYPES = ("float32", "bfloat16", "float16")


def _positive(value: int | None, key: str, least: int = 1) -> None:
    check(value is None or value >= least, key, f"must be at least {least}, got {value}")


def _within(value: int, context: int, key: str) -> None:
    check(value <= context, key, f"{value} is longer than the model's context of {context} tokens")


@dataclass
class PerplexityConfig:
    file: str = DEFAULT_EVAL_TEXT
    seq_len: int | None = None      # None: min(512, the model's context)
    stride: int | None = None       # None: seq_len // 2
    max_tokens: int | None = None
    batch_size: int = 4

    def validate(self) -> None:
        _positive(self.seq_len, "seq_len", 2)
        _positive(self.stride, "stride")
        _positive(self.max_tokens, "max_tokens", 2)
        _positive(self.batch_size, "batch_size")
        if self.stride is not None and self.seq_len is not None:
            check(self.stride <= self.seq_len, "stride",
                  f"{self.stride} is longer than seq_len {self.seq_len} (windows would skip tokens)")

    def for_context(self, context: int | None) -> "PerplexityConfig":
        """A copy with ``seq_len`` and ``stride`` filled in; ConfigError if they cannot work."""
        self.validate()
        seq_len = self.seq_len or (PERPLEXITY_SEQ_LEN if context is None else min(PERPLEXITY_SEQ_LEN, context))
        if context is not None:
            _within(seq_len, context, "seq_len")
        stride = self.stride or max(1, seq_len // 2)
        check(stride <= seq_len, "stride", f"{stride} is longer than seq_len {seq_len}"
              + ("" if self.seq_len else " (the default seq_len"
                 + (f" for a {context}-token context)" if context else ")"))
              + ": windows would skip tokens")
        return dataclasses.replace(self, seq_len=seq_len, stride=stride)


@dataclass
class KLConfig:
    file: str = DEFAULT_EVAL_TEXT
    windows: int = 8
    seq_len: int | None = None      # None: min(256, the model's context)
    top_k: int | None = None        # None: keep the base's whole distributions
    batch_size: int = 4

    def validate(self) -> None:
        _positive(self.windows, "windows")
        _positive(self.seq_len, "seq_len", 2)
        _positive(self.top_k, "top_k")
        _positive(self.batch_size, "batch_size")

    def for_context(self, context: int | None) -> "KLConfig":
        self.validate()
        seq_len = self.seq_len or (KL_SEQ_LEN if context is None else min(KL_SEQ_LEN, context))
        if context is not None:
            _within(seq_len, context, "seq_len")
        return dataclasses.replace(self, seq_len=seq_len)


@dataclass
class SpeedConfig:
    prompt_len: int | None = None   # None: min(128, context - new_tokens)
    new_tokens: int | None = None   # None: min(64, context // 2)
    repeats: int = 3
    warmup: int = 1

    def validate(self) -> None:
        _positive(self.prompt_len, "prompt_len")
        _positive(self.new_tokens, "new_tokens")
        _positive(self.repeats, "repeats")
        _positive(self.warmup, "warmup", 0)

    def for_context(self, context: int | None) -> "SpeedConfig":
        """A copy with ``prompt_len`` and ``new_tokens`` filled in so that both fit the context."""
        self.validate()
        if context is None:
            return dataclasses.replace(self, prompt_len=self.prompt_len or SPEED_PROMPT_LEN,
                                       new_tokens=self.new_tokens or SPEED_NEW_TOKENS)
        if self.prompt_len is not None:
            check(self.prompt_len < context, "prompt_len", f"{self.prompt_len} leaves no room to generate "
                  f"in the model's context of {context} tokens")
        room = context - self.prompt_len if self.prompt_len else context // 2
        new_tokens = self.new_tokens or max(1, min(SPEED_NEW_TOKENS, room))
        check(new_tokens < context, "new_tokens", f"{new_tokens} leaves no room for a prompt in the "
              f"model's context of {context} tokens")
        prompt_len = self.prompt_len or min(SPEED_PROMPT_LEN, context - new_tokens)
        check(prompt_len + new_tokens <= context, "prompt_len",
              f"prompt_len {prompt_len} + new_tokens {new_tokens} = {prompt_len + new_tokens} tokens "
              f"do not fit the model's context of {context} tokens")
        return dataclasses.replace(self, prompt_len=prompt_len, new_tokens=new_tokens)


@dataclass
class SpeculativeEvalConfig:
    """Each stage in ``drafts`` as a speculative draft of the base (the target): batch 1,
    greedy, ``prompts`` windows of ``prompt_len`` tokens of ``file`` (None: the perplexity
    file, else the default eval text), ``new_tokens`` each, the target alone and with the
    draft alternately over ``rounds`` rounds."""
    drafts: list[str] = field(default_factory=list)
    k: int = 3                      # draft tokens per verify pass
    new_tokens: int = 64
    prompts: int = 4
    prompt_len: int = 64
    rounds: int = 3
    file: str | None = None

    def validate(self) -> None:
        check(bool(self.drafts), "drafts", "name at least one stage to measure as a draft of the base")
        for name in self.drafts:
            check(isinstance(name, str) and bool(name), "drafts", f"expected stage names, got {name!r}")
        check(len(set(self.drafts)) == len(self.drafts), "drafts", f"a stage is named twice: {self.drafts}")
        _positive(self.k, "k")
        _positive(self.new_tokens, "new_tokens", 2)
        _positive(self.prompts, "prompts")
        _positive(self.prompt_len, "prompt_len", 2)
        _positive(self.rounds, "rounds")

    def for_context(self, context: int | None) -> "SpeculativeEvalConfig":
        self.validate()
        if context is not None:
            check(self.prompt_len + self.new_tokens <= context, "prompt_len",
                  f"prompt_len {self.prompt_len} + new_tokens {self.new_tokens} = "
                  f"{self.prompt_len + self.new_tokens} tokens do not fit the model's context of {context} tokens")
        return dataclasses.replace(self, drafts=list(self.drafts))


SECTIONS = {"perplexity": PerplexityConfig, "kl": KLConfig, "speed": SpeedConfig,
            "speculative": SpeculativeEvalConfig}


@dataclass
class EvalConfig:
    perplexity: PerplexityConfig | None = field(default_factory=PerplexityConfig)
    kl: KLConfig | None = field(default_factory=KLConfig)
    tasks: list[str] = field(default_factory=list)     # lm-eval task names; none unless asked
    task_limit: int | float | None = None
    task_batch_size: int = 8
    speed: SpeedConfig | None = field(default_factory=SpeedConfig)
    speculative: SpeculativeEvalConfig | None = None   # stages as drafts of the base; off unless given
    threads: int | None = None
    dtype: str = "float32"
    kernels: str = "native"
    w4_activations: str = DEFAULT_W4_ACTIVATIONS  # int4 layers: float activations (the scheme's numbers) or int8 (CPU fast path)
    progress: bool = True

    def validate(self) -> None:
        check(self.kernels in KERNELS, "kernels", f"must be one of {list(KERNELS)}, got {self.kernels!r}")
        check(self.dtype in EVAL_DTYPES, "dtype", f"must be one of {list(EVAL_DTYPES)}, got {self.dtype!r}")
        check(self.w4_activations in W4_ACTIVATIONS, "w4_activations",
              f"must be one of {list(W4_ACTIVATIONS)}, got {self.w4_activations!r}")
        _positive(self.task_batch_size, "task_batch_size")
        limit = self.task_limit
        check(limit is None or (not isinstance(limit, bool) and (
            (isinstance(limit, int) and limit >= 1) or (isinstance(limit, float) and 0 < limit <= 1))),
            "task_limit", f"must be a count of at least 1 or a fraction in (0, 1], got {limit!r}")
        _positive(self.threads, "threads")
        for name in SECTIONS:
            section = getattr(self, name)
            if section is not None:
                _validate_section(name, section.validate)

    def for_context(self, context: int | None) -> "EvalConfig":
        """A copy with every context-dependent default filled in (ConfigError naming
        ``perplexity.stride`` and the like for a value the context cannot take)."""
        sized = {name: _validate_section(name, getattr(self, name).for_context, context)
                 for name in SECTIONS if getattr(self, name) is not None}
        return dataclasses.replace(self, **sized)

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
            raise ConfigError(f"unknown eval setting(s) {sorted(unknown)}; known: {sorted(known)}", "eval")
        kw = dict(d)
        for key, sub in SECTIONS.items():
            if key in kw:
                kw[key] = _section(sub, key, kw[key])
        cfg = cls(**kw)
        try:
            cfg.validate()
        except ConfigError as exc:
            raise ConfigError(exc.message, f"eval.{exc.where}") from None
        return cfg


def sized_section(cfg: EvalConfig, name: str, context: int | None):
    """``cfg``'s section ``name`` sized to ``context`` (ConfigError at ``eval.NAME.KEY``)."""
    try:
        return getattr(cfg, name).for_context(context)
    except ConfigError as exc:
        raise ConfigError(exc.message, f"eval.{name}.{exc.where}" if exc.where else f"eval.{name}") from None


def _validate_section(name: str, method, *args):
    """Call a section's ``validate``/``for_context``, its key prefixed with the section's name."""
    try:
        return method(*args)
    except ConfigError as exc:
        raise ConfigError(exc.message, f"{name}.{exc.where}" if exc.where else name) from None


def _section(cls, name, value):
    if value is None or value is False:
        return None
    if isinstance(value, cls):
        return value
    if value is True:
        return cls()
    if not isinstance(value, dict):
        raise ConfigError(f"expected a mapping, true or false, got {value!r}", f"eval.{name}")
    known = {f.name for f in fields(cls)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}", f"eval.{name}")
    return cls(**value)


def check_eval_against_context(cfg: EvalConfig, context: int | None, where: str = "eval",
                               resolve=None) -> None:
    """Raise ConfigError (``where.perplexity.stride`` and the like) for a setting the model's
    context cannot take, or (given ``resolve``, a recipe's path resolver) an evaluation
    text that does not exist. ``context`` None checks only what needs no context."""
    try:
        cfg.validate()
        cfg.for_context(context)
    except ConfigError as exc:
        raise ConfigError(exc.message, f"{where}.{exc.where}" if exc.where else where) from None
    if resolve is None:
        return
    for name in ("perplexity", "kl", "speculative"):
        section = getattr(cfg, name)
        if section is not None and section.file is not None and not Path(resolve(section.file)).is_file():
            raise ConfigError(f"evaluation text not found: {resolve(section.file)}", f"{where}.{name}.file")


def speculative_text(cfg: EvalConfig) -> str:
    """The text the speculative prompts are cut from: its own ``file``, else the
    perplexity file, else the default eval text (unresolved: the caller resolves)."""
    spec = cfg.speculative
    if spec is not None and spec.file is not None:
        return spec.file
    return cfg.perplexity.file if cfg.perplexity is not None else DEFAULT_EVAL_TEXT


def check_speculative_drafts(cfg: EvalConfig, stages: list[str], where: str = "eval") -> None:
    """ConfigError at ``where.speculative.drafts`` for a draft that names no stage of the
    recipe (the base is the target, not a draft)."""
    if cfg.speculative is None:
        return
    for name in cfg.speculative.drafts:
        if name not in stages:
            raise ConfigError(f"{name!r} names no stage of the recipe (stages: {', '.join(stages)}); "
                              "each draft is a stage measured as a draft of the base",
                              f"{where}.speculative.drafts")
