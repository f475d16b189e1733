"""Loaders for the local pydoc tasks (``custom_dataset`` in their YAMLs): jsonl files
shipped next to this module, read without any dataset hub."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, **kwargs):
    import datasets
    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_ppl(**kwargs):
    return _load("pydoc_ppl.jsonl")


def load_cloze(**kwargs):
    return _load("pydoc_cloze.jsonl")
