"""Training checkpoints of a distillation run: atomic, resumable, tied to their recipe.

A checkpoint is a directory ``step-NNNNNNN`` in the run's checkpoint directory holding

- ``weights.safetensors``: the student's parameters (and the hidden-loss projections,
  prefixed ``projection.``), as trained (float32);
- ``optimizer.safetensors``: AdamW's per-parameter state (``state.<index>.<key>``) and
  the torch RNG state (``rng.torch``);
- ``state.json``: the step (the data position: batches done; the learning-rate schedule
  is a function of the step), the optimizer's param groups, Python's RNG state, the
  run's fingerprint and what the run measured so far.

It is written into a temporary directory that is renamed into place when complete (a
killed run leaves either the old or the new checkpoint, never half of one); older
checkpoints are removed after the rename. Tensors are read back with safetensors and
the rest with json: nothing is unpickled.

The fingerprint describes what determines the run (the step's settings, the training
data, the student's and teacher's weights, the world size); resuming under another
fingerprint is a :class:`CheckpointMismatch` naming what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from compress.errors import StepError
from compress.io.files import fsync_dir, fsync_file

PREFIX = "step-"


class CheckpointMismatch(StepError):
    pass


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-1 of the module's parameters (names, dtypes, shapes, bytes)."""
    h = hashlib.sha1()
    for name, p in module.named_parameters():
        t = p.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class TrainState:
    """What a resumed run continues from."""
    step: int
    meta: dict            # what the run measured so far (stats)


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested settings as dotted keys (``step.lr``), so a mismatch names the leaf that changed."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class CheckpointDir:
    def __init__(self, directory: str | Path, fingerprint: dict, where: str):
        self.directory, self.fingerprint, self.where = Path(directory), fingerprint, where

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name[len(PREFIX):]) for p in self.directory.iterdir()
                      if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit())

    def path(self, step: int) -> Path:
        return self.directory / f"{PREFIX}{step:07d}"

    def save(self, step: int, student: torch.nn.Module, projections: torch.nn.Module | None,
             optimizer: torch.optim.Optimizer, meta: dict) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        for stale in self.directory.glob(f".{PREFIX}*.tmp-*"):      # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        weights = {n: p.detach().cpu().contiguous() for n, p in student.named_parameters()}
        if projections is not None:
            weights.update({f"projection.{n}": p.detach().cpu().contiguous()
                            for n, p in projections.named_parameters()})
        save_file(weights, str(tmp / "weights.safetensors"))
        opt = optimizer.state_dict()
        tensors = {f"state.{i}.{k}": v.cpu().contiguous() for i, st in opt["state"].items() for k, v in st.items()}
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        py_state = random.getstate()
        state = {"step": step, "fingerprint": self.fingerprint, "param_groups": opt["param_groups"],
                 "python_rng": [py_state[0], list(py_state[1]), py_state[2]], "meta": meta}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(self.directory)
        for old in self.steps():
            if old < step:
                shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def latest_state(self) -> dict | None:
        steps = self.steps()
        if not steps:
            return None
        state_file = self.path(steps[-1]) / "state.json"
        try:
            return json.loads(state_file.read_text())
        except (OSError, ValueError) as exc:
            raise self._corrupt(state_file, exc) from None

    def _corrupt(self, path: Path, exc: Exception) -> "CheckpointMismatch":
        return CheckpointMismatch(f"{self.where}: {path}: a corrupt checkpoint ({exc}); delete {self.directory} "
                                  "to start over")

    def check_fingerprint(self) -> None:
        """A CheckpointMismatch when the directory holds a checkpoint of another run."""
        state = self.latest_state()
        if state is None:
            return
        saved, now = _flat(state["fingerprint"]), _flat(self.fingerprint)
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if differ:
            details = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in differ[:4])
            raise CheckpointMismatch(
                f"{self.where}: {self.path(state['step'])} is a checkpoint of a different run ({details}); "
                f"run the recipe it was made with to resume, or delete {self.directory} to start over")

    def load_latest(self, student: torch.nn.Module, projections: torch.nn.Module | None,
                    optimizer: torch.optim.Optimizer) -> TrainState | None:
        """Restore the newest checkpoint into the student, projections, optimizer and RNGs."""
        self.check_fingerprint()
        state = self.latest_state()
        if state is None:
            return None
        path = self.path(state["step"])
        try:
            weights = load_file(str(path / "weights.safetensors"))
            tensors = load_file(str(path / "optimizer.safetensors"))
            with torch.no_grad():
                for n, p in student.named_parameters():
                    p.copy_(weights[n])
                if projections is not None:
                    for n, p in projections.named_parameters():
                        p.copy_(weights[f"projection.{n}"])
        except (SafetensorError, OSError, KeyError, RuntimeError, ValueError) as exc:   # a missing / misshapen tensor
            raise self._corrupt(path, exc) from None
        opt_state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("state."):
                _, i, k = key.split(".", 2)
                opt_state.setdefault(int(i), {})[k] = value
        optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
        torch.set_rng_state(tensors["rng.torch"])
        version, internal, gauss = state["python_rng"]
        random.setstate((version, tuple(internal), gauss))
        return TrainState(state["step"], state["meta"])

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
