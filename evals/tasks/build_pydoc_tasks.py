#!/usr/bin/env python
"""Build the offline lm-eval task data from the held-out pydoc text (deterministic).

Writes next to this file:
  pydoc_ppl.jsonl    {"text"}: held-out documents, scored with loglikelihood_rolling
                     (word/byte perplexity, bits per byte), like lm-eval's wikitext;
  pydoc_cloze.jsonl  {"context", "choices", "label"}: a document prefix and four candidate
                     next words (the true one and three drawn, frequency-weighted, from the
                     other held-out documents); a trained model picks the true word far more
                     often than the 25 % of chance, a random model does not.

  python evals/tasks/build_pydoc_tasks.py [--source data/pydoc/eval.txt]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DOC_SEP = "\n\n\n"          # how data/pydoc/make_corpus.py joins documents
SEED = 20240601
PPL_DOCS = 300
CLOZE_ITEMS = 300
N_CHOICES = 4
MIN_CONTEXT_WORDS = 8
MAX_CONTEXT_CHARS = 400
WORD = re.compile(r"[A-Za-z_]+(?!['A-Za-z_])")
TARGET = re.compile(r"[a-z]{3,14}")


def read_docs(path: Path) -> list[str]:
    return [d.strip() for d in path.read_text(encoding="utf-8").split(DOC_SEP) if d.strip()]


def ppl_rows(docs: list[str]) -> list[dict]:
    return [{"text": d} for d in docs if len(d) >= 40][:PPL_DOCS]


def _context(doc: str, start: int) -> str:
    """The text before ``start`` (a space precedes it), at most MAX_CONTEXT_CHARS, cut at a line."""
    ctx = doc[:start - 1]
    if len(ctx) > MAX_CONTEXT_CHARS:
        cut = ctx[-MAX_CONTEXT_CHARS:]
        nl = cut.find("\n")
        ctx = cut[nl + 1:] if 0 <= nl < len(cut) - 40 else cut[cut.find(" ") + 1:]
    return ctx


def cloze_rows(docs: list[str], rng: random.Random) -> list[dict]:
    pool = [w for d in docs for w in WORD.findall(d) if TARGET.fullmatch(w)]
    candidates = []
    for di, doc in enumerate(docs):
        words = list(WORD.finditer(doc))
        spots = [m for k, m in enumerate(words) if k >= MIN_CONTEXT_WORDS
                 and TARGET.fullmatch(m.group()) and doc[m.start() - 1] == " "
                 and doc[m.start() - 2] not in " \n"
                 and (m.end() == len(doc) or not doc[m.end()].isalnum())]
        rng.shuffle(spots)
        candidates += [(di, m) for m in spots[:2]]
    rng.shuffle(candidates)
    rows = []
    for di, m in candidates[:CLOZE_ITEMS]:
        target = m.group()
        doc_words = set(WORD.findall(docs[di]))
        wrong: list[str] = []
        while len(wrong) < N_CHOICES - 1:
            w = rng.choice(pool)
            if w != target and w not in wrong and w not in doc_words:
                wrong.append(w)
        label = rng.randrange(N_CHOICES)
        choices = wrong[:label] + [target] + wrong[label:]
        rows.append({"context": _context(docs[di], m.start()), "choices": choices, "label": label})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", type=Path, default=REPO / "data/pydoc/eval.txt")
    p.add_argument("--out-dir", type=Path, default=HERE)
    args = p.parse_args(argv)
    docs = read_docs(args.source)
    ppl, cloze = ppl_rows(docs), cloze_rows(docs, random.Random(SEED))
    write_jsonl(ppl, args.out_dir / "pydoc_ppl.jsonl")
    write_jsonl(cloze, args.out_dir / "pydoc_cloze.jsonl")
    print(f"pydoc_ppl: {len(ppl)} docs; pydoc_cloze: {len(cloze)} items -> {args.out_dir}")


if __name__ == "__main__":
    main()
