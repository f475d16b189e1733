"""``compress run``: recipe -> stages of steps -> packed exports -> evaluation -> report.

Data travels one way: each stage reads the base model's files (or an earlier stage's
export) block by block, applies its steps, and writes its export as the blocks finish
(``compress/stage_executor.py``); then every stage is evaluated from its exported checkpoint by the runtime, so the
figures in the report are those of the files a user ships.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.calibration import load_calibration_ids
from compress.dtypes import DTYPES
from compress.io.checkpoint import resolve_model_path
from compress.model_loading import read_arch
from compress.recipe import Recipe


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class StageResult:
    name: str
    path: str
    seconds: float
    quantized_layers: int
    stats: dict = field(default_factory=dict)   # the steps' StepContext.stats


def compress_stages(recipe: Recipe, output: Path, progress: bool = True, log=print) -> tuple[Path, list[StageResult]]:
    """Apply every stage and export it to ``output/<stage>``. Returns (base model dir, results).

    Each stage streams its source (the base model's files, or the export of the stage it
    starts from) block by block into its own export (``compress/stage_executor.py``):
    memory stays near one block whatever the model's size and the number of stages."""
    from transformers import AutoConfig, AutoTokenizer

    from compress.io.export import tokenizer_files
    from compress.memory_estimate import check_memory
    from compress.model_source import ModelSource
    from compress.stage_executor import build_skeleton, run_stage

    seed_everything(recipe.seed)
    model_dir = resolve_model_path(recipe.model_location)
    arch = read_arch(model_dir)
    trust = recipe.model.trust_remote_code
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust)
    working = None if recipe.model.dtype == "auto" else DTYPES[recipe.model.dtype]
    base = ModelSource(model_dir, working)
    dense_dtype = base.dtype if recipe.export.dense_dtype == "auto" else DTYPES[recipe.export.dense_dtype]
    skeleton = build_skeleton(config, arch, trust)
    check_memory(recipe, skeleton, arch, log)
    n_params = sum(p.numel() for p in skeleton.parameters())
    log(f"reading {model_dir} ({arch.model_type}, {n_params / 1e6:.1f}M parameters, "
        f"{base.nbytes() / 1e9:.2f} GB stored as {str(base.stored_dtype).replace('torch.', '')})")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    # the source's tokenizer files as they are (a sentencepiece tokenizer.model, the chat
    # template), rather than what the loaded tokenizer object would write back
    tokenizer_source = model_dir if tokenizer_files(Path(model_dir)) else tokenizer
    generation_config = _generation_config(model_dir, config)
    calib_cache: dict[str, torch.Tensor] = {}

    def calibration() -> torch.Tensor:
        if "ids" not in calib_cache:
            c = recipe.calibration
            calib_cache["ids"] = load_calibration_ids([recipe.resolve(f) for f in c.files], tokenizer,
                                                      c.samples, c.seq_len, c.seed, c.field, c.dataset)
        return calib_cache["ids"]

    training = recipe.training
    if training is not None:
        training = dataclasses.replace(training, files=[recipe.resolve(f) for f in training.files])
    results = []
    resolved = recipe.resolved_yaml()
    for stage in recipe.stages:
        t0 = time.perf_counter()
        seed_everything(recipe.seed)
        if stage.source == "base":
            # a fresh skeleton a stage: a stage that loads a tied lm_head replaces its
            # Parameter, which would untie it for the next stage (on meta: no memory)
            source, stage_skeleton = base, skeleton if not results else build_skeleton(config, arch, trust)
        else:   # an earlier stage's export: its own shapes (a pruned stage is smaller than the base)
            source = ModelSource(output / stage.source, working)
            source_config = AutoConfig.from_pretrained(output / stage.source, trust_remote_code=trust)
            if hasattr(source_config, "quantization_config"):
                del source_config.quantization_config
            stage_skeleton = build_skeleton(source_config, arch, trust)
        out_dir = output / stage.name
        log(f"[{stage.name}] {' + '.join(s.method for s in stage.steps)} on {stage.source}")
        done = run_stage(stage, stage_skeleton, arch, source, out_dir, calibration, seed=recipe.seed,
                         dense_dtype=dense_dtype, max_shard_bytes=recipe.export.max_shard_bytes,
                         finish_kwargs=dict(tokenizer=tokenizer_source, recipe_text=resolved,
                                            extra_manifest={"stage": stage.name, "source": stage.source},
                                            generation_config=generation_config),
                         teacher_of=lambda step: step.teacher.directory(model_dir, output),
                         training=training, progress=progress, log=log)
        results.append(StageResult(stage.name, str(out_dir), time.perf_counter() - t0, done.quantized_layers,
                                   done.stats))
        log(f"[{stage.name}] exported {done.quantized_layers} quantized layers to {out_dir} "
            f"in {results[-1].seconds:.1f}s")
    return model_dir, results


def _generation_config(model_dir: Path, config):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return GenerationConfig.from_model_config(config)


def launched_rank() -> int:
    """This process's rank under torchrun / accelerate launch (0 when alone)."""
    import os

    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def run_recipe(recipe: Recipe, output: Path | None = None, evaluate: bool = True,
               progress: bool = True, threads: int | None = None, log=print) -> dict:
    """The whole job; returns the report records (also written to ``output``).

    Under torchrun every process runs the recipe (a distill step trains data-parallel,
    ``distill/distributed.py``); rank 0 writes ``output`` and evaluates, the others write
    their (identical) exports to a scratch directory removed at the end."""
    output = Path(output or recipe.resolve(recipe.export.output))
    if threads or recipe.eval.threads:
        torch.set_num_threads(threads or recipe.eval.threads)
    rank = launched_rank()
    if rank > 0:
        import shutil

        scratch = output / f".rank{rank}"
        try:
            compress_stages(recipe, scratch, progress=False, log=lambda *_: None)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {"stages": [], "rank": rank}
    base_dir, results = compress_stages(recipe, output, progress, log)
    if not evaluate:
        return {"stages": [r.__dict__ for r in results]}
    from evals.report import machine_info, write_report

    records = evaluate_stages(recipe, [("base", str(base_dir))] + [(r.name, r.path) for r in results],
                              progress, log)
    write_report(records, output, title=f"compress report: {recipe.name}",
                 machine={**machine_info(torch.get_num_threads()), "recipe": str(recipe.path), "seed": recipe.seed})
    failed = [f"{r['name']} {cell}" for r in records for cell in r.get("errors", {})]
    if failed:
        log(f"[eval] {len(failed)} cell(s) could not be measured ({', '.join(failed)}): "
            f"see Errors in {output / 'report.md'}")
    return {"stages": records, "report": str(output / "report.md"), "failed_cells": failed}


def evaluate_stages(recipe: Recipe, stages: list[tuple[str, str]], progress: bool = True, log=print) -> list[dict]:
    """One record per (name, checkpoint dir); the first is the base and the KL reference
    (and the target of ``eval.speculative``'s drafts, measured once every stage is).
    A measurement that fails is recorded in its record's ``errors``; the others go on."""
    from evals.evaluate import evaluate_checkpoint

    cfg = dataclasses.replace(recipe.eval, progress=progress)
    for key in ("perplexity", "kl"):
        section = getattr(cfg, key)
        if section is not None:
            setattr(cfg, key, dataclasses.replace(section, file=recipe.resolve(section.file)))
    kl_cache: dict = {}
    records = []
    for name, path in stages:
        log(f"[eval] {name}: {path}")
        seed_everything(recipe.seed)
        records.append(evaluate_checkpoint(path, cfg, kl_cache, name=name))
    if cfg.speculative is not None:   # stages as drafts of the base: figures in their records
        from evals.eval_config import speculative_text
        from evals.speculative import evaluate_drafts

        seed_everything(recipe.seed)
        evaluate_drafts(records, cfg.speculative, recipe.resolve(speculative_text(recipe.eval)), dtype=cfg.dtype,
                        kernels=cfg.kernels, w4_activations=cfg.w4_activations, log_fn=log)
    return records
