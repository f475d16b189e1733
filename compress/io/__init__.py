"""Checkpoint I/O: the on-disk format (safetensors + manifest), export, load and inspect.

    export_checkpoint(out_dir, model_config, state_dict_dense, quantized, ...) -> Path
    load_checkpoint(path, verify=True) -> Checkpoint
    resolve_model_path(name_or_path) -> Path
    inspect_checkpoint(path) -> dict;  format_inspect(d) -> str
"""
from compress.io.checkpoint import Checkpoint, CheckpointError, load_checkpoint, resolve_model_path
from compress.io.export import ExportError, export_checkpoint
from compress.io.formats import FORMAT_NAME, FORMAT_VERSION
from compress.io.inspect import format_inspect, inspect_checkpoint
from compress.io.schemes import SCHEMES, QuantizedWeight

__all__ = ["Checkpoint", "CheckpointError", "ExportError", "FORMAT_NAME", "FORMAT_VERSION", "QuantizedWeight",
           "SCHEMES", "export_checkpoint", "format_inspect", "inspect_checkpoint", "load_checkpoint",
           "resolve_model_path"]
