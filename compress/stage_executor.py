"""Running one recipe stage block by block, from files to files.

A stage never holds its model: the module tree is built on the ``meta`` device
(:func:`build_skeleton`; only the rotary buffers are real), and for each decoder block
in turn the executor

1. reads the block's tensors from the stage's source (the base model's safetensors, or
   an earlier stage's export: ``compress/model_source.py``) into the skeleton, upcast
   to float32 for the computations;
2. runs every step of the stage on it (``compress/block_steps.py``), each calibrated
   step with its own stream of calibration activations, advanced through the block as
   that step left it -- exactly what running the steps one after the other over the
   whole model computes;
3. writes the block's packed and dense tensors into the export's shards
   (``CheckpointWriter``) and puts the block back on ``meta``.

Then the linears outside the blocks that a step takes (an ``lm_head`` for RTN) and every
other tensor (embedding, final norm) are streamed from the source to the export. Peak
memory is about one float32 block, the embedding (as stored) while the calibration set
is embedded, and the calibration activations -- not the model.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from compress.calibration import BlockInputs, CalibrationError, advance, capture_first_block_inputs
from compress.config import ConfigError
from compress.errors import StepError
from compress.io.export import CheckpointWriter
from compress.io.schemes import QuantizedWeight
from compress.model_source import ModelSource, SourceError
from compress.registry import get_method
from compress.runtime.heap import release_free_heap
from compress.state import StepContext

COMPUTE_DTYPE = torch.float32


def build_skeleton(config, arch, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree with every parameter on ``meta`` and real buffers."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE, trust_remote_code=trust_remote_code)
    parent, _, child = arch.rotary_emb.rpartition(".")
    rotary = model.get_submodule(arch.rotary_emb)
    setattr(model.get_submodule(parent), child, type(rotary)(config=model.config))
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise SourceError(f"{config.model_type}: buffer {meta_buffers[0]!r} cannot be rebuilt from the config "
                          f"(the architecture table knows only {arch.rotary_emb!r})")
    return model.eval()


class Materializer:
    """Moves a module's parameters between the source's files and ``meta``."""

    def __init__(self, model: nn.Module, source: ModelSource):
        self.model, self.source = model, source
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self.aliases = aliases          # tied parameters: every name of one tensor

    def source_name(self, full: str, param: nn.Parameter) -> str:
        for name in [full] + self.aliases.get(id(param), []):
            if name in self.source:
                return name
        raise SourceError(f"{self.source.directory}: no tensor {full!r} in its safetensors files")

    def load(self, module: nn.Module, prefix: str) -> dict[str, QuantizedWeight]:
        """Real parameters for ``module`` (path ``prefix``); returns the QuantizedWeights
        of its linears that the source holds quantized (carried over by the stage)."""
        carried = {}
        for local, param in list(module.named_parameters()):
            full = f"{prefix}.{local}" if prefix else local
            name = self.source_name(full, param)
            qw = self.source.quantized(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if qw is not None:
                carried[full.removesuffix(".weight")] = qw
                t = qw.dequantize().to(COMPUTE_DTYPE)
            else:
                t = self.source.weight(name, COMPUTE_DTYPE)
            if tuple(t.shape) != tuple(param.shape):
                raise SourceError(f"{self.source.directory}: tensor {name!r} has shape {list(t.shape)}, "
                                  f"the config makes it {list(param.shape)}")
            _set_parameter(module, local, nn.Parameter(t, requires_grad=False))
        return carried

    @staticmethod
    def release(module: nn.Module) -> None:
        for local, param in list(module.named_parameters()):
            _set_parameter(module, local, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False))
        # a block's tensors are mostly under glibc's adaptive mmap threshold: without this
        # the heap keeps the pages of every freed block and RSS creeps up block after block
        release_free_heap()


def _set_parameter(module: nn.Module, local: str, param: nn.Parameter) -> None:
    owner, _, leaf = local.rpartition(".")
    (module.get_submodule(owner) if owner else module)._parameters[leaf] = param


@contextlib.contextmanager
def step_errors(where: str):
    """A ValueError inside a step becomes a StepError naming the step."""
    try:
        yield
    except (ConfigError, CalibrationError, SourceError, StepError):
        raise
    except ValueError as exc:
        raise StepError(f"{where}: {exc}") from exc


@dataclass
class StageOutput:
    quantized_layers: int
    stats: dict = field(default_factory=dict)


class ModelTransform:
    """A step that rewrites the float model as a whole (a ``transform`` method: prune,
    distill) instead of working block by block. ``run`` reads ``source`` (through
    :class:`Materializer` and :func:`first_block_inputs` for calibrated passes, block by
    block), writes the new dense model's tensors into ``writer`` and returns its config.
    The executor runs a stage's transforms first (the recipe refuses a transform after a
    quantizing step), each into a temporary export that the next step reads."""

    def run(self, source: ModelSource, skeleton: nn.Module, arch, calibration: Callable[[], torch.Tensor],
            writer: CheckpointWriter):
        raise NotImplementedError


def first_block_inputs(skeleton: nn.Module, arch, source: ModelSource, ids: torch.Tensor,
                       batch_size: int) -> BlockInputs:
    """What decoder block 0 receives for calibration ``ids``: the embedding rows read as
    stored (never the whole table in float32), the rotary tables and masks of the skeleton."""
    weight = skeleton.get_submodule(arch.embed_tokens).weight
    table = source.weight(Materializer(skeleton, source).source_name(f"{arch.embed_tokens}.weight", weight))

    def embed(batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(batch, table).to(COMPUTE_DTYPE)

    return capture_first_block_inputs(skeleton, arch, ids, batch_size, embed)


def run_stage(stage, skeleton: nn.Module, arch, source: ModelSource, out_dir: Path,
              calibration: Callable[[], torch.Tensor], *, seed: int, dense_dtype: torch.dtype,
              max_shard_bytes: int, finish_kwargs: dict[str, Any], teacher_of: Callable | None = None,
              training=None, progress: bool = True, log=print) -> StageOutput:
    """Apply ``stage``'s steps to ``source`` and export to ``out_dir``: its transform
    steps first, each into a temporary export beside ``out_dir``, then its block steps,
    block by block. ``teacher_of(step)``: the directory of the step's teacher model;
    ``training``: the recipe's training section (absolute paths) or None."""
    import shutil

    stats: dict = {}

    def context(step) -> StepContext:
        return StepContext(where=step.where, calibration=calibration, seed=seed, progress=progress, stats=stats,
                           teacher=teacher_of(step) if teacher_of is not None else None, training=training)

    transforms = [st for st in stage.steps if get_method(st.method).kind == "transform"]
    rest = stage.steps[len(transforms):]
    if any(get_method(st.method).kind == "transform" for st in rest):
        raise ConfigError("a transform step cannot follow a quantizing step", rest[0].where)
    temps: list[Path] = []
    try:
        for k, step in enumerate(transforms):
            last = k + 1 == len(transforms) and not rest
            target = out_dir if last else out_dir.parent / f".{out_dir.name}.step{k + 1}"
            with step_errors(step.where):
                transform = get_method(step.method).step(skeleton, arch, step.config, context(step))
                log(f"[{stage.name}] {step.method}")
                with CheckpointWriter(target, dense_dtype, max_shard_bytes) as writer:
                    config = transform.run(source, skeleton, arch, calibration, writer)
                    writer.finish(config, **finish_kwargs)
            if last:
                return StageOutput(0, stats)
            temps.append(target)
            source = ModelSource(target, source.dtype)
            skeleton = build_skeleton(config, arch)
        steps = []
        for step in rest:
            with step_errors(step.where):
                steps.append((step, get_method(step.method).step(skeleton, arch, step.config, context(step))))
        return _run_block_steps(stage, steps, skeleton, arch, source, out_dir, calibration, stats,
                                dense_dtype, max_shard_bytes, finish_kwargs, progress)
    finally:
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)


def _run_block_steps(stage, steps, skeleton, arch, source, out_dir, calibration, stats, dense_dtype,
                     max_shard_bytes, finish_kwargs, progress) -> StageOutput:
    from tqdm.auto import tqdm

    loader = Materializer(skeleton, source)
    blocks = skeleton.get_submodule(arch.layers)
    streams: dict[int, BlockInputs] = {}
    calibrated = [j for j, (_, s) in enumerate(steps) if s.calibrated and s.per_block]
    if calibrated:
        ids = calibration()
        by_batch: dict[int, BlockInputs] = {}
        for j in calibrated:
            bs = steps[j][1].batch_size
            if bs not in by_batch:
                by_batch[bs] = first_block_inputs(skeleton, arch, source, ids, bs)
            streams[j] = by_batch[bs]
        del by_batch

    config = skeleton.config
    with CheckpointWriter(out_dir, dense_dtype, max_shard_bytes) as writer:
        written: set[str] = set()

        def write_module(module: nn.Module, prefix: str, quantized: dict[str, QuantizedWeight]) -> None:
            for local, param in module.named_parameters():
                full = f"{prefix}.{local}"
                mod = full.removesuffix(".weight")
                if full.endswith(".weight") and mod in quantized:
                    writer.add_quantized(mod, quantized[mod])
                else:
                    writer.add_dense(full, param.data)
                written.add(full)

        def recorder(quantized: dict[str, QuantizedWeight], sync: bool):
            """``sync``: something runs this module again (a later step, or the calibration
            stream), so its float weight becomes the quantized function; else the float
            weight is left as it is (it is not written) and the dequantization skipped."""
            def record(name: str, module: nn.Linear, qw: QuantizedWeight) -> None:
                quantized[name] = qw
                if sync:
                    with torch.no_grad():
                        module.weight.copy_(qw.dequantize().to(module.weight.dtype))
            return record

        bar = tqdm(total=len(blocks), desc=f"{stage.name}: {'+'.join(st.method for st, _ in steps)}",
                   unit="block", disable=not progress)
        for index, block in enumerate(blocks):
            prefix = f"{arch.layers}.{index}"
            quantized = loader.load(block, prefix)
            for j, (step, runner) in enumerate(steps):
                with step_errors(step.where):
                    if index in runner.per_block:
                        later = any(index in r.per_block for _, r in steps[j + 1:])
                        record = recorder(quantized, sync=later or (j in streams and index + 1 < len(blocks)))
                        runner.block(index, block, streams.get(j), record)
                    if j in streams and index + 1 < len(blocks):
                        streams[j] = advance(block, streams[j], index, arch)
            write_module(block, prefix, quantized)
            loader.release(block)
            bar.update(1)
        bar.close()
        streams.clear()

        outside: dict[str, list] = {}
        for step, runner in steps:
            for name in runner.outside:
                outside.setdefault(name, []).append((step, runner))
        for name, takers in outside.items():
            module = skeleton.get_submodule(name)
            quantized = loader.load(module, name)
            for k, (step, runner) in enumerate(takers):
                with step_errors(step.where):
                    runner.outside_linear(name, module, recorder(quantized, sync=k + 1 < len(takers)))
            write_module(module, name, quantized)
            loader.release(module)
            if getattr(config, "tie_word_embeddings", False) and name == arch.lm_head:
                config = _untied(config)          # the head now has its own (quantized) tensors

        # everything else as stored: embedding, final norm, a dense lm_head, extra tensors;
        # not a head equal to the embedding of a tied config (transformers and the runtime
        # tie it on load: a stored copy would only double the bytes). A tied config's head
        # stored with other values is kept, and the config says untied (transformers does
        # not tie two different tensors either).
        head, embed_name = f"{arch.lm_head}.weight", f"{arch.embed_tokens}.weight"
        if getattr(config, "tie_word_embeddings", False) and head in source and head not in written \
                and embed_name in source:
            if torch.equal(source.weight(head), source.weight(embed_name)):
                written.add(head)
            else:
                config = _untied(config)
        for name in source.names():
            if name in written:
                continue
            mod = name.removesuffix(".weight")
            qw = source.quantized(mod) if name.endswith(".weight") else None
            if qw is not None:
                writer.add_quantized(mod, qw)
            else:
                writer.add_dense(name, source.weight(name))
            written.add(name)
        for _, runner in steps:
            runner.finish(stats)
        writer.finish(config, **finish_kwargs)
    return StageOutput(len(writer.layers), stats)


def _untied(config):
    import copy

    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    return config
