"""The distill step as the stage executor runs it: load, check, train, write.

``DistillTransform(model, arch, config, ctx)`` checks the teacher against the model it
is given before any work (a missing directory, a different vocabulary); ``run`` loads
the student (the stage's current model, float32, whole) and the frozen teacher, builds
the training windows (the recipe's ``training:`` section, or the default pydoc text,
less ``held_out_windows`` kept for the held-out loss), trains (``distill/trainer.py``)
with checkpoints beside the export (``<output>/<stage>.distill-checkpoints``, removed
when the run completes), and writes the student's tensors under the source's names.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from compress.errors import StepError
from compress.stage_executor import ModelTransform
from compress.training_data import TrainingDataError, load_training_data
from distill.checkpoint import CheckpointDir, weights_digest
from distill.config import DistillConfig
from distill.distributed import World

DEFAULT_TOKENS = 262144
DEFAULT_SEQ_LEN = 256


class DistillTransform(ModelTransform):
    def __init__(self, model, arch, config: DistillConfig, ctx):
        from transformers import AutoConfig

        self.config, self.where, self.progress, self.stats = config, ctx.where, ctx.progress, ctx.stats
        self.training, self.seed = ctx.training, ctx.seed if config.seed is None else config.seed
        if ctx.teacher is None or not Path(ctx.teacher, "config.json").is_file():
            raise StepError(f"{ctx.where}: the teacher {ctx.teacher!r} is not a model directory (no config.json)")
        self.teacher_dir = ctx.teacher
        teacher_config = AutoConfig.from_pretrained(ctx.teacher)
        check_vocabulary(model.config.vocab_size, teacher_config.vocab_size, ctx.teacher, ctx.where)

    def budget(self) -> tuple[int, int]:
        t = self.training
        tokens = self.config.tokens or (t.tokens if t is not None else DEFAULT_TOKENS)
        seq_len = self.config.seq_len or (t.seq_len if t is not None else DEFAULT_SEQ_LEN)
        if tokens < seq_len:
            raise StepError(f"{self.where}: tokens ({tokens}) must be at least seq_len ({seq_len})")
        return tokens, seq_len

    def data_spec(self) -> dict:
        """The training text: the recipe's section, or the default pydoc text."""
        tokens, seq_len = self.budget()
        t = self.training
        if t is None:
            from distill.default_text import default_training_file

            return {"files": [str(default_training_file())], "field": "text", "dataset": None,
                    "tokens": tokens, "seq_len": seq_len, "seed": self.seed, "default_text": True}
        return {"files": list(t.files), "field": t.field, "dataset": t.dataset, "tokens": tokens,
                "seq_len": seq_len, "seed": t.seed, "default_text": False}

    def windows(self, tokenizer, spec: dict):
        """(training data, held-out windows) of ``spec``."""
        k = self.config.held_out_windows
        try:
            data = load_training_data(spec["files"], tokenizer, spec["tokens"] + k * spec["seq_len"],
                                      spec["seq_len"], spec["seed"], spec["field"], spec["dataset"])
        except TrainingDataError as exc:
            raise StepError(f"{self.where}: {exc}") from None
        n = data.windows.shape[0]
        if n <= k:
            raise StepError(f"{self.where}: the training text makes {n} windows of {spec['seq_len']} tokens; "
                            f"held_out_windows={k} would leave none to train on")
        train = dataclasses.replace(data, windows=data.windows[:n - k], tokens=spec["tokens"])
        return train, data.windows[n - k:]

    def run(self, source, skeleton, arch, calibration, writer):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from distill.trainer import Trainer

        refuse_quantized(source.directory, self.where, "source")
        refuse_quantized(self.teacher_dir, self.where, "teacher")
        world = World.from_env()
        tokenizer = AutoTokenizer.from_pretrained(source.directory)
        spec = self.data_spec()
        train, held_out = self.windows(tokenizer, spec)
        student = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32)
        teacher = AutoModelForCausalLM.from_pretrained(self.teacher_dir, dtype=torch.float32)
        check_vocabulary(student.get_output_embeddings().weight.shape[0],
                         teacher.get_output_embeddings().weight.shape[0], self.teacher_dir, self.where)
        # what determines the weights (how often to evaluate or checkpoint does not)
        settings = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in ("eval_every",
                                                                                         "checkpoint_every")}
        fingerprint = {"step": settings | {"seed": self.seed}, "training": spec,
                       "student": weights_digest(student), "teacher": weights_digest(teacher),
                       "world_size": world.size}
        if self.config.teacher_dtype == "bfloat16":
            teacher = teacher.to(torch.bfloat16)
        out = Path(writer.out_dir)
        checkpoints = CheckpointDir(out.parent / f"{out.name}.distill-checkpoints", fingerprint, self.where)
        trainer = Trainer(student, teacher, self.config, self.where, self.seed, world)
        batches = list(train.batches(self.config.batch_size))
        result = trainer.run(batches, held_out, checkpoints, self.progress)
        self.stats["distill"] = {
            "steps": result.steps, "tokens": sum(b.numel() for b in batches), "seq_len": spec["seq_len"],
            "tokens_this_run": result.tokens, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s,
            "resumed_from_step": result.resumed_from, "loss_first": result.losses[0] if result.losses else None,
            "loss_last": result.losses[-1] if result.losses else None, "held_out": result.held_out,
            "default_text": spec["default_text"], "world_size": world.size}
        write_student(trainer.whole_student(), source, writer)
        world.barrier()
        if world.rank == 0:
            checkpoints.remove()
        return skeleton.config


def check_vocabulary(student_vocab: int, teacher_vocab: int, teacher_dir, where: str) -> None:
    if student_vocab != teacher_vocab:
        raise StepError(f"{where}: the teacher {teacher_dir} has a vocabulary of {teacher_vocab} tokens and the "
                        f"student {student_vocab}; distillation compares their logits token by token and needs "
                        "the same vocabulary (tokenizer)")


def refuse_quantized(directory, where: str, role: str) -> None:
    from compress.model_source import ModelSource

    groups = ModelSource(directory).groups
    if groups:
        raise StepError(f"{where}: the {role} {directory} holds quantized layers ({next(iter(groups))}, ...); "
                        "distillation trains and compares float models: distill before quantizing")


def write_student(student, source, writer) -> None:
    """The student's tensors under the names the source stores (a tied head once)."""
    params = dict(student.named_parameters(remove_duplicate=False))
    covered = set()
    for name in source.names():
        if name not in params:
            raise StepError(f"{source.directory}: tensor {name!r} has no parameter in the loaded student")
        writer.add_dense(name, params[name].detach())
        covered.add(id(params[name]))
    missing = [n for n, p in params.items() if id(p) not in covered]
    if missing:
        raise StepError(f"{source.directory}: the student's parameter {missing[0]!r} is not among the source's tensors")
