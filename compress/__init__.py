"""compress: a quantization and compression workbench for Hugging Face causal LMs."""
__version__ = "0.1.0"
