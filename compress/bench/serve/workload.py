"""Seeded synthetic serving workloads, as token ids.

Prompts are windows of real text already turned into token ids (a corpus), so every
length is exact in tokens and every peer gets the same ids; outputs are fixed lengths
that the servers are asked to reach with ``ignore_eos``. Three shapes:

* ``random``: prompt lengths uniform in [32, 512], output lengths uniform in [16, 128]
  (vLLM's ``random`` dataset, with real text instead of random ids);
* ``shared-prefix``: one long common prefix (default 1,024 tokens) followed by a short
  distinct suffix, for prefix caching;
* ``long-prompt``: a few requests decoding (``role="running"``) when one 2,000-token
  prompt (``role="long"``) arrives, for the stall that an unchunked prefill causes.

Arrivals: Poisson at a given rate (exponential gaps, seeded), or all at once under a
fixed concurrency (the runner's business). The same seed gives the same workload."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from compress.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TEXT_FILES = (REPO_ROOT / "data" / "pydoc" / "eval.txt", REPO_ROOT / "data" / "pydoc" / "calib.txt")
WORKLOADS = ("random", "shared-prefix", "long-prompt")


class WorkloadError(UserError):
    """A workload that cannot be built (names the setting)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt as token ids, the exact number of tokens to generate, and
    its role in the workload (``request``; ``running`` / ``long`` in ``long-prompt``)."""
    prompt: tuple[int, ...]
    max_tokens: int
    role: str = "request"


@dataclass(frozen=True)
class WorkloadSettings:
    """Lengths of each workload, in tokens (inclusive ranges)."""
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 128)
    prefix_len: int = 1024                 # shared-prefix: the common prefix
    suffix_len: tuple[int, int] = (32, 128)  # shared-prefix: each request's own tail
    running: int = 6                       # long-prompt: requests decoding when the long one arrives
    running_prompt_len: tuple[int, int] = (32, 128)
    running_output_len: int = 256          # long enough to still decode through the long prefill
    long_prompt_len: int = 2000
    long_output_len: int = 16


def _check_range(name: str, r: tuple[int, int]) -> None:
    if len(r) != 2 or r[0] < 1 or r[1] < r[0]:
        raise WorkloadError(f"{name} {r}: need 1 <= low <= high")


def corpus_ids(texts: Sequence[str], encode: Callable[[str], list[int]]) -> list[int]:
    """All texts' token ids, one after the other (no special tokens between them)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(encode(text))
    return ids


def read_texts(files: Sequence[str | Path] | None = None) -> list[str]:
    """The text of ``files`` (default: the repository's pydoc evaluation and calibration
    text), each file one text."""
    out = []
    for f in files or DEFAULT_TEXT_FILES:
        p = Path(f)
        if not p.is_file():
            raise WorkloadError(f"prompt text file {p} does not exist")
        out.append(p.read_text(encoding="utf-8", errors="replace"))
    return out


def _window(corpus: Sequence[int], length: int, rng: random.Random, what: str) -> tuple[int, ...]:
    if length > len(corpus):
        raise WorkloadError(f"{what}: {length} tokens asked, the prompt text has only {len(corpus)}; "
                            "give more text with --text")
    start = rng.randint(0, len(corpus) - length)
    return tuple(corpus[start:start + length])


def random_workload(corpus: Sequence[int], n: int, seed: int,
                    settings: WorkloadSettings = WorkloadSettings()) -> list[BenchRequest]:
    """``n`` requests of uniformly drawn prompt and output lengths; prompts are windows
    of the corpus at uniformly drawn offsets."""
    _check_range("prompt length", settings.prompt_len)
    _check_range("output length", settings.output_len)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*settings.prompt_len)
        o = rng.randint(*settings.output_len)
        out.append(BenchRequest(_window(corpus, p, rng, "random prompt"), o))
    return out


def shared_prefix_workload(corpus: Sequence[int], n: int, seed: int,
                           settings: WorkloadSettings = WorkloadSettings()) -> list[BenchRequest]:
    """``n`` requests that all start with the same ``prefix_len`` tokens, each followed
    by its own suffix; output lengths as in ``random``."""
    _check_range("suffix length", settings.suffix_len)
    _check_range("output length", settings.output_len)
    if settings.prefix_len < 1:
        raise WorkloadError(f"prefix length {settings.prefix_len}: must be at least 1")
    rng = random.Random(seed)
    prefix = _window(corpus, settings.prefix_len, rng, "shared prefix")
    out = []
    for _ in range(n):
        s = rng.randint(*settings.suffix_len)
        o = rng.randint(*settings.output_len)
        out.append(BenchRequest(prefix + _window(corpus, s, rng, "suffix"), o))
    return out


def long_prompt_workload(corpus: Sequence[int], seed: int,
                         settings: WorkloadSettings = WorkloadSettings()) -> list[BenchRequest]:
    """``running`` short requests that decode ``running_output_len`` tokens each, then
    the ``long_prompt_len``-token request (last in the list)."""
    _check_range("running prompt length", settings.running_prompt_len)
    if settings.running < 1:
        raise WorkloadError(f"running requests {settings.running}: must be at least 1")
    rng = random.Random(seed)
    out = [BenchRequest(_window(corpus, rng.randint(*settings.running_prompt_len), rng, "running prompt"),
                        settings.running_output_len, role="running") for _ in range(settings.running)]
    out.append(BenchRequest(_window(corpus, settings.long_prompt_len, rng, "long prompt"),
                            settings.long_output_len, role="long"))
    return out


def build_workload(name: str, corpus: Sequence[int], n: int, seed: int,
                   settings: WorkloadSettings = WorkloadSettings()) -> list[BenchRequest]:
    if name == "random":
        return random_workload(corpus, n, seed, settings)
    if name == "shared-prefix":
        return shared_prefix_workload(corpus, n, seed, settings)
    if name == "long-prompt":
        return long_prompt_workload(corpus, seed, settings)
    raise WorkloadError(f"workload {name!r}: choose one of {', '.join(WORKLOADS)}")


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests arriving as a Poisson
    process of ``rate`` requests per second: the first at 0, then exponential gaps."""
    if not rate > 0:
        raise WorkloadError(f"request rate {rate}: must be more than 0 requests/s")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def local_encoder(model_dir: str | Path) -> Callable[[str], list[int]] | None:
    """Text -> token ids with the checkpoint's own ``tokenizer.json`` (no special
    tokens), or None when it has none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: tok.encode(text, add_special_tokens=False).ids
