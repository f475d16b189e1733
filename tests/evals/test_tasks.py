import json
from pathlib import Path

from evals.tasks import TASKS, task_dir
from evals.tasks.build_pydoc_tasks import main as build

REPO = Path(__file__).resolve().parents[2]


def test_build_is_deterministic_and_matches_shipped_files(tmp_path):
    build(["--out-dir", str(tmp_path)])
    for name in ("pydoc_ppl.jsonl", "pydoc_cloze.jsonl"):
        assert (tmp_path / name).read_bytes() == (task_dir() / name).read_bytes(), name


def test_task_files_are_well_formed():
    d = task_dir()
    for t in TASKS:
        assert (d / f"{t}.yaml").is_file()
    ppl = [json.loads(x) for x in (d / "pydoc_ppl.jsonl").read_text().splitlines()]
    assert 100 <= len(ppl) <= 400 and all(r["text"].strip() for r in ppl)
    cloze = [json.loads(x) for x in (d / "pydoc_cloze.jsonl").read_text().splitlines()]
    assert 100 <= len(cloze) <= 400
    for r in cloze:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4 and 0 <= r["label"] < 4
        assert r["context"] and not r["context"][-1].isspace()
    labels = [r["label"] for r in cloze]
    assert all(labels.count(k) > len(cloze) // 8 for k in range(4))


def test_tasks_load_offline_through_lm_eval():
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=str(task_dir()), include_defaults=False)
    tasks = tm.load(list(TASKS))["tasks"]
    cloze = tasks["pydoc_cloze"]
    doc = cloze.test_docs()[0]
    assert cloze.doc_to_choice(doc)[cloze.doc_to_target(doc)] == doc["choices"][doc["label"]]
    assert len(tasks["pydoc_ppl"].test_docs()) == len(
        (task_dir() / "pydoc_ppl.jsonl").read_text().splitlines())
