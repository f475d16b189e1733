"""Recipes: YAML files describing model, calibration data, stages of steps, export
and evaluation. Parsing validates everything up front and names the file, the stage,
the step and the key of any problem.

Relative paths in a recipe are resolved against the recipe file's directory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from compress.config import ConfigError, check, from_dict, to_dict
from compress.registry import get_method
from evals.eval_config import EvalConfig

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


@dataclass
class Step:
    method: str
    config: Any
    where: str


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
        for key in ("perplexity", "kl"):
            if ev[key]:
                ev[key]["file"] = self.resolve(ev[key]["file"])
        doc = {
            "name": self.name, "seed": self.seed,
            "model": model, "calibration": calib,
            "stages": [{"name": st.name, "from": st.source,
                        "steps": [{"method": s.method, **to_dict(s.config)} for s in st.steps]}
                       for st in self.stages],
            "export": to_dict(self.export), "eval": ev,
        }
        return (f"# resolved from {self.path}: defaults filled in, paths made absolute\n"
                + yaml.safe_dump(doc, sort_keys=False))


TOP_KEYS = {"name", "seed", "model", "calibration", "steps", "stages", "export", "eval"}


def _parse_steps(raw_steps: Any, where: str) -> list[Step]:
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
        steps.append(Step(name, from_dict(method.config_class, body, step_where), step_where))
    return steps


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
        stages.append(Stage(st_name, source, _parse_steps(raw.get("steps"), st_where)))

    return Recipe(
        path=path, name=name, seed=seed,
        model=from_dict(ModelConfig, data["model"], f"{where}: model"),
        calibration=from_dict(CalibrationConfig, data.get("calibration"), f"{where}: calibration"),
        stages=stages,
        export=from_dict(ExportConfig, data.get("export"), f"{where}: export"),
        eval=from_dict(EvalConfig, data.get("eval"), f"{where}: eval"),
        raw=data,
    )


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("recipe file not found", str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"malformed YAML: {getattr(exc, 'problem', exc)}", loc) from None
    return parse_recipe(data, path.resolve())
