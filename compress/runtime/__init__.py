"""The compress runtime: our own Llama-family decoder over the compress ops.

Depends only on ``compress.ops``, ``compress.io`` and ``compress.architectures``;
never on the compressor (pipeline, quantizers, pruning, distill).
"""
from compress.runtime.engine import LLM
from compress.runtime.sampling import SamplingParams
from compress.runtime.llm_engine import LLMEngine
from compress.runtime.sequence import RequestOutput
from compress.runtime.scoring import Loglikelihood

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "Loglikelihood"]
