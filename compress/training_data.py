"""Training data (distillation): text files, jsonl files or (online) a Hugging Face
dataset made into a deterministic stream of token windows.

The recipe's ``training:`` section (compress/recipe.py ``TrainingConfig``) is kept
apart from ``calibration:``: calibration is a few hundred sequences for statistics,
training a token budget for gradient steps. :func:`load_training_data` reads the
documents with calibration's readers, tokenizes them in order (an EOS after each) until
the budget is covered, and cuts the stream into ``seq_len`` windows;
:meth:`TrainingData.batches` yields ``[batch, seq_len]`` windows covering ``tokens``
tokens in all, in an order shuffled by ``seed`` (a new permutation for each pass when
the data is shorter than the budget). The same inputs give the same batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from compress.calibration import CalibrationError, _dataset_texts, _read_texts
from compress.errors import UserError


class TrainingDataError(UserError):
    pass


@dataclass(frozen=True)
class TrainingData:
    windows: torch.Tensor       # [n, seq_len] int64: the token stream cut into windows
    tokens: int                 # the training budget, in tokens
    seed: int

    @property
    def seq_len(self) -> int:
        return self.windows.shape[1]

    @property
    def steps(self) -> int:
        """Windows in the budget: ``tokens // seq_len``."""
        return self.tokens // self.seq_len

    def order(self) -> torch.Tensor:
        """Which window comes when: seeded permutations of all windows, one after the
        other, cut at the budget."""
        gen = torch.Generator().manual_seed(self.seed)
        n = self.windows.shape[0]
        passes = -(-self.steps // n)
        return torch.cat([torch.randperm(n, generator=gen) for _ in range(passes)])[:self.steps]

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """``[batch_size, seq_len]`` token ids (the last batch may be smaller)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = self.order()
        for start in range(0, order.numel(), batch_size):
            yield self.windows[order[start:start + batch_size]]


def load_training_data(files: list[str], tokenizer, tokens: int, seq_len: int, seed: int,
                       field: str = "text", dataset: str | None = None) -> TrainingData:
    """The training windows of ``files`` (absolute paths: text, or jsonl with ``field``)
    and ``dataset`` ("name[:config]:split", online only), in that order."""
    if seq_len < 2 or tokens < seq_len:
        raise TrainingDataError(f"training needs seq_len >= 2 and tokens >= seq_len, got seq_len={seq_len}, "
                                f"tokens={tokens}")
    texts = _training_texts(files, field, dataset)
    wanted = (tokens // seq_len) * seq_len
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if len(ids) >= wanted:
            break
    n = min(len(ids), wanted) // seq_len
    if n == 0:
        raise TrainingDataError(f"the training text has {len(ids)} tokens, fewer than one window of "
                                f"seq_len={seq_len} ({_sources(files, dataset)})")
    windows = torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)
    return TrainingData(windows, tokens, seed)


def _training_texts(files: list[str], field: str, dataset: str | None) -> list[str]:
    texts: list[str] = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise TrainingDataError(f"training file not found: {path}")
        try:
            texts.extend(_read_texts(path, field))
        except CalibrationError as exc:          # the shared reader's message names file:line
            raise TrainingDataError(f"training data: {exc}") from None
    if dataset:
        try:
            texts.extend(_dataset_texts(dataset, field))
        except CalibrationError as exc:
            raise TrainingDataError(f"training data: {exc}") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise TrainingDataError(f"the training set is empty ({_sources(files, dataset)}): "
                                "give 'files' or a 'dataset' that hold text")
    return texts


def _sources(files: list[str], dataset: str | None) -> str:
    named = [str(f) for f in files] + ([f"dataset {dataset}"] if dataset else [])
    return ", ".join(named) or "no files and no dataset"
