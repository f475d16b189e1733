"""Speculative decoding in the engine: drafters (a draft model, prompt lookup), the
speculative step (``decoder.py``) and the rejection sampler (``rejection.py``)."""
from compress.runtime.speculative.config import SpeculativeConfig
from compress.runtime.speculative.decoder import SpeculativeDecoder
from compress.runtime.speculative.model_drafter import ModelDrafter
from compress.runtime.speculative.ngram_drafter import NgramDrafter

__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "ModelDrafter", "NgramDrafter"]
