"""Recipes: YAML files describing model, calibration data, training data, stages of
steps, export and evaluation. Parsing validates everything up front and names the file,
the stage, the step and the key of any problem: unknown keys and bad values, a ``from:``
or ``teacher:`` naming no earlier stage, a step that transforms the float model (prune,
distill) after a quantizing step of the same chain of stages.

Relative paths in a recipe are resolved against the recipe file's directory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from compress.config import ConfigError, check, from_dict, to_dict
from compress.registry import METHODS, get_method
from evals.eval_config import EvalConfig, check_speculative_drafts

STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class ModelConfig:
    path: str
    # the precision the weights are taken in; "auto" = as the checkpoint stores them (the
    # computations upcast one block at a time to float32 either way)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False


@dataclass
class CalibrationConfig:
    files: list[str] = field(default_factory=list)
    field: str = "text"                 # jsonl field holding the text
    dataset: str | None = None          # "name[:config]:split" from the HF hub (online only)
    samples: int = 64
    seq_len: int = 256
    seed: int = 0

    def validate(self) -> None:
        check(self.samples > 0, "samples", f"must be > 0, got {self.samples}")
        check(self.seq_len > 1, "seq_len", f"must be > 1, got {self.seq_len}")


@dataclass
class TrainingConfig:
    """Training data (distillation), apart from the calibration set: ``tokens`` tokens
    in ``seq_len`` windows, shuffled with ``seed`` (compress/training_data.py)."""
    files: list[str] = field(default_factory=list)
    field: str = "text"                 # jsonl field holding the text
    dataset: str | None = None          # "name[:config]:split" from the HF hub (online only)
    tokens: int = 262144                # training tokens in all (windows repeat when the data is shorter)
    seq_len: int = 256
    seed: int = 0

    def validate(self) -> None:
        check(bool(self.files) or bool(self.dataset), "files",
              "the training section needs data: give 'files' (text or jsonl) or a 'dataset'")
        check(self.seq_len > 1, "seq_len", f"must be > 1, got {self.seq_len}")
        check(self.tokens >= self.seq_len, "tokens",
              f"must be at least seq_len ({self.seq_len}), got {self.tokens}")


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(value: int | str) -> int | None:
    """Bytes from ``5000000``, ``"500MB"``, ``"2GiB"``, ``"5GB"``; None when unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in SIZE_UNITS:
        return None
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


@dataclass
class ExportConfig:
    output: str = "out"
    # the dtype of the tensors left in float (embeddings, norms, unquantized linears);
    # "auto" = the model's working dtype (model.dtype), so a bf16 model stays bf16
    dense_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # shards of at most this size (model-0000k-of-0000n.safetensors + the index json)
    max_shard_size: int | str = "2GiB"

    def validate(self) -> None:
        size = parse_size(self.max_shard_size)
        check(size is not None and size > 0, "max_shard_size",
              f"must be a positive size like 2GiB, 500MB or a number of bytes, got {self.max_shard_size!r}")

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)


@dataclass(frozen=True)
class TeacherRef:
    """A step's teacher: an earlier stage's model (``stage``: 'base' or a stage name) or
    a model directory (``path``, absolute)."""
    stage: str | None = None
    path: str | None = None

    def directory(self, base_dir: str | Path, output: str | Path) -> str:
        """The teacher's model directory, given the base model's and the run's output
        directory (where stage ``x`` is exported to ``output/x``)."""
        if self.path is not None:
            return self.path
        return str(base_dir if self.stage == "base" else Path(output) / self.stage)

    def as_yaml(self) -> str:
        return self.path if self.path is not None else self.stage


@dataclass
class Step:
    method: str
    config: Any
    where: str
    teacher: TeacherRef = TeacherRef(stage="base")   # the stage's source unless the step names one


@dataclass
class Stage:
    name: str
    source: str          # stage this one starts from ("base" = the loaded model)
    steps: list[Step]


@dataclass
class Recipe:
    path: Path
    name: str
    seed: int
    model: ModelConfig
    calibration: CalibrationConfig
    stages: list[Stage]
    export: ExportConfig
    eval: EvalConfig
    raw: dict
    training: TrainingConfig | None = None     # no 'training:' section: none

    def resolve(self, p: str | None) -> str | None:
        """A recipe-relative path made absolute (hub ids and absolute paths unchanged)."""
        if p is None:
            return None
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (self.path.parent / q).resolve())

    @property
    def model_location(self) -> str:
        """The model as a recipe-relative directory when it exists there, else as given (a hub id)."""
        local = self.resolve(self.model.path)
        return local if Path(local).exists() else self.model.path

    @property
    def needs_calibration(self) -> bool:
        return any(get_method(s.method).needs_calibration for st in self.stages for s in st.steps)

    def resolved_yaml(self) -> str:
        """The recipe with every default filled in, as saved next to each export."""
        model, calib, ev = to_dict(self.model), to_dict(self.calibration), to_dict(self.eval)
        model["path"] = self.model_location
        calib["files"] = [self.resolve(f) for f in calib["files"]]
        for key in ("perplexity", "kl", "speculative"):
            if ev[key] and ev[key]["file"] is not None:
                ev[key]["file"] = self.resolve(ev[key]["file"])
        doc = {
            "name": self.name, "seed": self.seed,
            "model": model, "calibration": calib,
        }
        if self.training is not None:
            training = to_dict(self.training)
            training["files"] = [self.resolve(f) for f in training["files"]]
            doc["training"] = training
        doc.update({
            "stages": [{"name": st.name, "from": st.source, "steps": [_step_yaml(s) for s in st.steps]}
                       for st in self.stages],
            "export": to_dict(self.export), "eval": ev,
        })
        return (f"# resolved from {self.path}: defaults filled in, paths made absolute\n"
                + yaml.safe_dump(doc, sort_keys=False))


def _step_yaml(step: Step) -> dict:
    doc = {"method": step.method, **to_dict(step.config)}
    if get_method(step.method).uses_teacher:
        doc["teacher"] = step.teacher.as_yaml()
    return doc


TOP_KEYS = {"name", "seed", "model", "calibration", "training", "steps", "stages", "export", "eval"}


def _parse_steps(raw_steps: Any, where: str, source: str, earlier: list[str], recipe_dir: Path) -> list[Step]:
    """A stage's steps; ``source``: the stage it starts from, ``earlier``: the stages
    before it (a ``teacher:`` may name those or 'base')."""
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ConfigError("'steps' must be a non-empty list of {method: NAME, ...}", where)
    steps = []
    for i, raw in enumerate(raw_steps):
        step_where = f"{where} step {i + 1}"
        if not isinstance(raw, dict) or "method" not in raw:
            raise ConfigError("each step must be a mapping with a 'method' key", step_where)
        name = raw["method"]
        try:
            method = get_method(name)
        except KeyError as exc:
            raise ConfigError(exc.args[0], f"{step_where}.method") from None
        body = {k: v for k, v in raw.items() if k != "method"}
        step_where = f"{step_where} ({name})"
        teacher = TeacherRef(stage=source)
        if method.uses_teacher and "teacher" in body:     # other methods' configs refuse the key
            teacher = _resolve_teacher(body.pop("teacher"), earlier, recipe_dir, f"{step_where}.teacher")
        steps.append(Step(name, from_dict(method.config_class, body, step_where), step_where, teacher))
    return steps


def _resolve_teacher(value: Any, earlier: list[str], recipe_dir: Path, where: str) -> TeacherRef:
    """'base' or an earlier stage's name, else a model directory (recipe-relative) that exists."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"'teacher' must be a stage name or a model directory, got {value!r}", where)
    if value == "base" or value in earlier:
        return TeacherRef(stage=value)
    path = Path(value).expanduser()
    path = path if path.is_absolute() else (recipe_dir / path).resolve()
    if path.is_dir():
        return TeacherRef(path=str(path))
    stages = ", ".join(["base", *earlier])
    found = "is a file, not a model directory" if path.exists() else "does not exist"
    raise ConfigError(f"teacher {value!r} names no earlier stage ({stages}) and {path} {found}", where)


def _check_order(stages: list[Stage], where: str) -> None:
    """No step transforms the float model (prune, distill) once a step of its chain of
    stages (this stage, or those its ``from:`` runs through) has quantized it."""
    quantized_by: dict[str, str | None] = {"base": None}     # stage -> its chain's first quantizing step
    for stage in stages:
        quantized = quantized_by[stage.source]
        for step in stage.steps:
            method = get_method(step.method)
            if method.kind == "transform" and quantized is not None:
                raise ConfigError(f"{step.method} transforms the float model, but {quantized} has quantized "
                                  f"this chain already: put transform steps (prune, distill) before "
                                  f"quantizing ones ({', '.join(_quantizing_methods())})", step.where)
            if method.kind == "quantize" and quantized is None:
                quantized = step.where.removeprefix(f"{where}: ")
        quantized_by[stage.name] = quantized


def _quantizing_methods() -> list[str]:
    return sorted(name for name, m in METHODS.items() if m.kind == "quantize")


def parse_recipe(data: Any, path: Path) -> Recipe:
    where = str(path)
    if not isinstance(data, dict):
        raise ConfigError("a recipe must be a YAML mapping", where)
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown top-level key {unknown[0]!r}; valid keys: {', '.join(sorted(TOP_KEYS))}", where)
    if "model" not in data:
        raise ConfigError("missing required section 'model'", where)
    if ("steps" in data) == ("stages" in data):
        raise ConfigError("give exactly one of 'steps' (one stage) or 'stages' (several)", where)
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not STAGE_NAME.match(name):
        raise ConfigError(f"'name' must be letters, digits, '.', '_' or '-', got {name!r}", f"{where}: name")
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"'seed' must be an integer, got {seed!r}", f"{where}: seed")

    raw_stages = [{"name": name, "steps": data["steps"]}] if "steps" in data else data["stages"]
    if not isinstance(raw_stages, list) or not raw_stages:
        raise ConfigError("'stages' must be a non-empty list", f"{where}: stages")
    stages: list[Stage] = []
    for i, raw in enumerate(raw_stages):
        st_where = f"{where}: stage {i + 1}"
        if not isinstance(raw, dict):
            raise ConfigError("each stage must be a mapping with 'name' and 'steps'", st_where)
        bad = sorted(set(raw) - {"name", "from", "steps"})
        if bad:
            raise ConfigError(f"unknown key {bad[0]!r}; a stage has name, from, steps", st_where)
        st_name = raw.get("name")
        if not isinstance(st_name, str) or not STAGE_NAME.match(st_name) or st_name == "base":
            raise ConfigError(f"stage name must be letters, digits, '.', '_' or '-' and not 'base', got {st_name!r}",
                              f"{st_where}.name")
        if any(s.name == st_name for s in stages):
            raise ConfigError(f"duplicate stage name {st_name!r}", f"{st_where}.name")
        source = raw.get("from", "base")
        if source != "base" and not any(s.name == source for s in stages):
            raise ConfigError(f"'from: {source}' names no earlier stage (earlier: base"
                              f"{''.join(', ' + s.name for s in stages)})", f"{st_where}.from")
        st_where = f"{where}: stage {st_name!r}"
        stages.append(Stage(st_name, source, _parse_steps(raw.get("steps"), st_where, source,
                                                          [s.name for s in stages], path.parent)))
    _check_order(stages, where)

    recipe = Recipe(
        path=path, name=name, seed=seed,
        model=from_dict(ModelConfig, data["model"], f"{where}: model"),
        calibration=from_dict(CalibrationConfig, data.get("calibration"), f"{where}: calibration"),
        stages=stages,
        export=from_dict(ExportConfig, data.get("export"), f"{where}: export"),
        eval=from_dict(EvalConfig, data.get("eval"), f"{where}: eval"),
        raw=data,
        training=(None if data.get("training") is None
                  else from_dict(TrainingConfig, data["training"], f"{where}: training")),
    )
    # a draft of the speculative eval is a stage of this recipe (the base is the target)
    check_speculative_drafts(recipe.eval, [s.name for s in stages], f"{where}: eval")
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("a directory, not a recipe file" if path.is_dir() else "recipe file not found", str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"malformed YAML: {getattr(exc, 'problem', exc)}", loc) from None
    return parse_recipe(data, path.resolve())
