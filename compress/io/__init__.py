"""Checkpoint I/O: the on-disk format (safetensors + manifest), export and load."""
