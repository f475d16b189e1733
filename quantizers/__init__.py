"""Quantization algorithms: primitives, round-to-nearest, LLM.int8(), AWQ."""
