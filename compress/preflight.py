"""Checks of a recipe against its model's ``config.json`` without loading any weight
(``compress run --dry-run``, and the start of every run): a shape a step cannot take,
an evaluation setting the model's context cannot hold. Each problem is a
:class:`compress.config.ConfigError` naming the file, the stage, the step and the key.

The model is built on the ``meta`` device from its config: every module and shape is
there, no memory is allocated and nothing is read but ``config.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from compress.config import ConfigError
from compress.registry import get_method


def model_config(recipe):
    """The model's transformers config, or ``None`` when the model is a hub id that is
    not on this machine (the checks then run at load time)."""
    from transformers import AutoConfig

    location = Path(recipe.model_location)
    if not (location / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(location, trust_remote_code=recipe.model.trust_remote_code)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the model's config: {exc}", f"{location / 'config.json'}") from None


def check_text_inputs(recipe, context: int | None) -> None:
    """The calibration and training files exist and are UTF-8 text, and their windows fit
    the model's context, before any model loads (ConfigError at ``calibration.files[i]``,
    ``training.seq_len``, ...)."""
    for section in ("calibration", "training"):
        cfg = getattr(recipe, section, None)
        if cfg is None or (section == "calibration" and not recipe.needs_calibration):
            continue
        for i, name in enumerate(cfg.files):
            path = Path(recipe.resolve(name))
            where = f"{recipe.path}: {section}.files[{i}]"
            if not path.is_file():
                raise ConfigError(f"{path}: " + ("is a directory, not a text file" if path.is_dir() else "not found"),
                                  where)
            try:
                with open(path, encoding="utf-8") as f:
                    while f.read(1 << 20):
                        pass
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})", where) from None
        if context is not None and cfg.seq_len > context:
            raise ConfigError(f"windows of {cfg.seq_len} tokens do not fit the model's context of {context}",
                              f"{recipe.path}: {section}.seq_len")


def meta_model(config) -> nn.Module:
    """The model's module tree with every tensor on the ``meta`` device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def preflight(recipe) -> list[str]:
    """Run every check the model's config allows; returns notes for the user (what was
    and was not checked). Raises ConfigError at the first problem."""
    from evals.backend import max_context
    from evals.eval_config import check_eval_against_context

    config = model_config(recipe)
    # the context the evaluation will size itself to (the same lookup as at run time)
    context = max_context(recipe.model_location) if config is not None else None
    check_eval_against_context(recipe.eval, context, where=f"{recipe.path}: eval", resolve=recipe.resolve)
    check_text_inputs(recipe, context)
    if recipe.eval.tasks:
        from evals.tasks import unknown_tasks

        unknown = unknown_tasks(list(recipe.eval.tasks))
        if unknown:
            raise ConfigError(f"lm-eval knows no task, group or tag {unknown}", f"{recipe.path}: eval.tasks")
    if config is None:
        return [f"model {recipe.model.path!r} is not a local directory: shapes are checked when it loads"]
    from compress.model_source import SourceError, check_source_quantization

    try:
        check_source_quantization(Path(recipe.model_location))
    except SourceError as exc:
        raise ConfigError(str(exc), f"{recipe.path}: model.path") from None
    model = meta_model(config)
    for stage in recipe.stages:
        for step in stage.steps:
            check = get_method(step.method).check_model
            if check is not None:
                check(model, step.config, step.where)
    from compress.architectures import get_arch
    from compress.memory_estimate import GB, available_bytes, check_estimate, estimate

    est = estimate(recipe, model, get_arch(config.model_type, where=str(Path(recipe.model_location) / "config.json")))
    free = available_bytes()
    check_estimate(recipe, est, free)   # --dry-run refuses what the run would
    return [f"checked against {Path(recipe.model_location) / 'config.json'}",
            f"memory estimate: {est.describe()}" + (f"; {free / GB:.1f} GB available" if free else "")]
