"""``speculative=`` of ``LLM`` / ``LLMEngine``: which drafter, how many tokens.

    {"model": "out/drafts/depth-int4", "num_speculative_tokens": 3}     # a draft model
    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_max": 4, "prompt_lookup_min": 1}                     # prompt lookup
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 3
    model: str | None = None            # a draft checkpoint (same vocabulary as the target)
    method: str | None = None           # 'draft_model' (with model) or 'ngram'
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method not in ("draft_model", "ngram"):
            raise ValueError(f"speculative: give a draft 'model' path or method 'ngram' (got method={self.method!r}, "
                             f"model={self.model!r})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative: method 'draft_model' needs 'model' (a draft checkpoint)")
        if int(self.num_speculative_tokens) < 1:
            raise ValueError(f"speculative: num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        self.num_speculative_tokens = int(self.num_speculative_tokens)

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A dict (keys above), a ``SpeculativeConfig``, a draft path, 'ngram', or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls(method="ngram") if value == "ngram" else cls(model=value)
        if not isinstance(value, dict):
            raise TypeError(f"speculative must be a dict, a draft path or 'ngram', got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)
