"""``compress run``: recipe -> stages of steps -> packed exports -> evaluation -> report.

Data travels one way: the base model is loaded once; each stage starts from a copy
of the base (or of an earlier stage), applies its steps in order, and is exported;
then every stage is evaluated from its exported checkpoint by the runtime, so the
figures in the report are those of the files a user ships.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.calibration import CalibrationError, load_calibration_ids
from compress.config import ConfigError
from compress.errors import StepError
from compress.dtypes import DTYPES
from compress.model_loading import load_model_for_compression
from compress.recipe import Recipe
from compress.registry import get_method
from compress.state import CompressionState, StepContext


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


def _later_sources(recipe: Recipe, index: int) -> set[str]:
    return {st.source for st in recipe.stages[index + 1:]}


def compress_stages(recipe: Recipe, output: Path, progress: bool = True, log=print) -> tuple[Path, list[StageResult]]:
    """Apply every stage and export it to ``output/<stage>``. Returns (base model dir, results)."""
    from compress.io.export import export_checkpoint, tokenizer_files

    seed_everything(recipe.seed)
    model, tokenizer, arch, model_dir = load_model_for_compression(
        recipe.model_location, recipe.model.dtype, recipe.model.trust_remote_code)
    log(f"loaded {model_dir} ({arch.model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")

    # the source's tokenizer files as they are (a sentencepiece tokenizer.model, the chat
    # template), rather than what the loaded tokenizer object would write back
    tokenizer_source = model_dir if tokenizer_files(Path(model_dir)) else tokenizer
    calib_cache: dict[str, torch.Tensor] = {}

    def calibration() -> torch.Tensor:
        if "ids" not in calib_cache:
            c = recipe.calibration
            calib_cache["ids"] = load_calibration_ids([recipe.resolve(f) for f in c.files], tokenizer,
                                                      c.samples, c.seq_len, c.seed, c.field, c.dataset)
        return calib_cache["ids"]

    states: dict[str, CompressionState] = {"base": CompressionState(model, arch, tokenizer, str(model_dir))}
    results = []
    resolved = recipe.resolved_yaml()
    for i, stage in enumerate(recipe.stages):
        t0 = time.perf_counter()
        src = states[stage.source]
        state = CompressionState(copy.deepcopy(src.model), src.arch, tokenizer, src.model_path,
                                 dict(src.quantized))
        stats: dict = {}
        for step in stage.steps:
            log(f"[{stage.name}] {step.method}")
            seed_everything(recipe.seed)
            ctx = StepContext(where=step.where, calibration=calibration, seed=recipe.seed, progress=progress,
                              stats=stats)
            try:
                get_method(step.method).apply(state, step.config, ctx)
            except (ConfigError, CalibrationError):
                raise
            except ValueError as exc:
                raise StepError(f"{step.where}: {exc}") from exc
        out_dir = output / stage.name
        dense = {k: v for k, v in state.model.state_dict().items()
                 if k.removesuffix(".weight") not in state.quantized}
        export_checkpoint(out_dir, state.model.config, dense, state.quantized, tokenizer=tokenizer_source,
                          recipe_text=resolved, extra_manifest={"stage": stage.name, "source": stage.source},
                          dense_dtype=DTYPES[recipe.export.dense_dtype],
                          generation_config=getattr(state.model, "generation_config", None))
        results.append(StageResult(stage.name, str(out_dir), time.perf_counter() - t0, len(state.quantized),
                                   stats))
        log(f"[{stage.name}] exported {len(state.quantized)} quantized layers to {out_dir} "
            f"in {results[-1].seconds:.1f}s")
        needed = _later_sources(recipe, i)
        if stage.name in needed:
            states[stage.name] = state
        for name in [n for n in states if n != "base" and n not in needed]:
            del states[name]
    return model_dir, results


def run_recipe(recipe: Recipe, output: Path | None = None, evaluate: bool = True,
               progress: bool = True, threads: int | None = None, log=print) -> dict:
    """The whole job; returns the report records (also written to ``output``)."""
    output = Path(output or recipe.resolve(recipe.export.output))
    if threads or recipe.eval.threads:
        torch.set_num_threads(threads or recipe.eval.threads)
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
    """One record per (name, checkpoint dir); the first is the base and the KL reference.
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
    return records
