"""Extract an English text corpus from the Python standard library's docstrings: the
embedded model's data (this directory's calib.txt and eval.txt, and the uncommitted
training text)::

    python data/pydoc/make_corpus.py              # (re)write calib.txt, eval.txt, out/pydoc/train.txt
    python data/pydoc/make_corpus.py --site-packages 2.0 --output /tmp/site-docs.txt

The second form writes held-out text in the same domain (English API documentation)
that no compress model trains or calibrates on: docstrings of the Python packages
installed beside this interpreter, cleaned the same way (e.g. the ``--text`` of
``compress eval PATH --base BASE --bootstrap OTHER``).

The stdlib sources are parsed with ``ast`` (modules are never imported) and every
module, class and function docstring is collected, lightly cleaned and
deduplicated. The pydoc help topics (``pydoc_data/topics.py``: the language
reference text that ``help("assert")`` shows) are added as well, one document
per topic, assigned to a split by the hash of ``pydoc_data/topics.py:<topic>``. Each source file is assigned to the ``train`` / ``calib`` / ``eval``
split by a stable SHA-1 hash of its path relative to the stdlib root, so the split
does not depend on the machine, only on the stdlib contents.

Documents are written separated by ``DOC_SEP`` (two blank lines); a document
never contains two consecutive blank lines itself.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import re
import sysconfig
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DOC_SEP = "\n\n\n"
SPLITS = ("train", "calib", "eval")

# Directory names (any depth) whose files are skipped: test suites, GUI/demo code,
# third-party packages, build config and codec tables.
SKIP_DIRS = {
    "test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages",
    "turtledemo", "__phello__", "__pycache__", "encodings", "pydoc_data",
}
TOPICS_FILE = "pydoc_data/topics.py"
SKIP_PREFIXES = ("config-", "lib-dynload")
MIN_CHARS = 40
MIN_WORDS = 6


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """Stable split assignment: ~88% train, ~6% calib, ~6% eval (per-mille buckets)."""
    bucket = int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest()[:8], 16) % 1000
    if bucket < 880:
        return "train"
    return "calib" if bucket < 940 else "eval"


def source_files(root: Path) -> list[tuple[str, Path]]:
    """Sorted (posix relative path, absolute path) for the stdlib's .py files."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts[:-1]
        if any(p in SKIP_DIRS or p.startswith(SKIP_PREFIXES) for p in parts):
            continue
        if rel.name.startswith("test_") or rel.name.startswith("_sysconfigdata"):
            continue
        out.append((rel.as_posix(), path))
    out.sort()
    return out


def _strip_doctests(text: str) -> str:
    """Drop interactive ``>>>`` examples (and their output up to the next blank line)."""
    keep, in_example = [], False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True
            continue
        if in_example:
            if stripped:
                continue
            in_example = False
        keep.append(line)
    return "\n".join(keep)


def clean_docstring(raw: str) -> str | None:
    text = inspect.cleandoc(raw).replace("\r\n", "\n").replace("\t", "    ")
    text = _strip_doctests(text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
        return None
    return text


def file_docstrings(path: Path) -> list[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    docs = []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, nodes):
            raw = ast.get_docstring(node, clean=False)
            if raw:
                text = clean_docstring(raw)
                if text:
                    docs.append(text)
    return docs


def topic_docs(root: Path) -> list[tuple[str, str]]:
    """(split key, text) for each pydoc help topic, read with ast.literal_eval."""
    path = root / TOPICS_FILE
    if not path.exists():
        return []
    tree = ast.parse(path.read_bytes(), filename=str(path))
    out = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            for key, raw in sorted(ast.literal_eval(node.value).items()):
                text = clean_docstring(raw)
                if text:
                    out.append((f"{TOPICS_FILE}:{key}", text))
    return out


def build_corpus(root: Path | None = None) -> dict[str, list[str]]:
    """Return {split: [document, ...]}; exact duplicates are kept only once overall."""
    root = root or stdlib_root()
    seen: set[str] = set()
    splits: dict[str, list[str]] = {s: [] for s in SPLITS}
    items = [(rel, doc) for rel, path in source_files(root) for doc in file_docstrings(path)]
    items += topic_docs(root)
    for key, doc in items:
        if doc not in seen:
            seen.add(doc)
            splits[split_of(key)].append(doc)
    return splits


def write_split(docs: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(DOC_SEP.join(docs) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_docs(path: Path) -> list[str]:
    return [d.strip() for d in path.read_text(encoding="utf-8").split(DOC_SEP) if d.strip()]


def site_packages_text(megabytes: float) -> str:
    """Deterministic sample of the installed packages' docstrings (files in SHA-1 order
    of their relative paths, test directories skipped), about ``megabytes`` MB."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(root.rglob("*.py"), key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    docs, seen, size = [], set(), 0
    for path in files:
        if any(part in ("tests", "test", "testing") for part in path.relative_to(root).parts):
            continue
        for doc in file_docstrings(path):
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
                size += len(doc)
        if size >= megabytes * 1e6:
            break
    return DOC_SEP.join(docs)


def write_data(data_dir: Path = HERE, train_text: Path = REPO / "out/pydoc/train.txt") -> dict[str, list[str]]:
    """(Re)write ``data_dir``'s calib.txt and eval.txt and the training text; returns the corpus."""
    corpus = build_corpus()
    write_split(corpus["calib"], data_dir / "calib.txt")
    write_split(corpus["eval"], data_dir / "eval.txt")
    write_split(corpus["train"], train_text)
    for name in SPLITS:
        docs = corpus[name]
        print(f"{name}: {len(docs)} docs, {sum(map(len, docs)) / 1e3:.0f} KB")
    return corpus


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=HERE, help="where calib.txt / eval.txt are written")
    p.add_argument("--train-text", type=Path, default=REPO / "out/pydoc/train.txt",
                   help="where the (uncommitted) training text is written")
    p.add_argument("--site-packages", type=float, metavar="MB",
                   help="instead: write this many MB of the installed packages' docstrings to --output")
    p.add_argument("--output", type=Path, help="the file --site-packages writes")
    args = p.parse_args(argv)
    if args.site_packages is None:
        write_data(args.data_dir, args.train_text)
        return
    if args.output is None:
        p.error("--site-packages needs --output FILE")
    write_split([site_packages_text(args.site_packages)], args.output)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
