#!/usr/bin/env python
"""What 2 MiB pages buy (compress/runtime/hugepages.py), measured in one process.

    python csrc/cpu/lab/ab_huge_pages.py /tmp/bench-llama2/rtn-int4 --threads 2 --sequences 6

1. A streaming read (``compress::stream_read_sum``) of a buffer in 4 KiB pages and of one
   in 2 MiB pages, alternating, each after a 256 MiB read that evicts the caches.
2. Greedy decode of the checkpoint in three configurations, switching configuration at
   every decode step (so the machine's drift hits all alike): weights and KV cache in
   4 KiB pages; weights in 2 MiB pages; weights and KV cache in 2 MiB pages. Prints the
   median step time of each and the speedup over the first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def read_ab(mib: int, rounds: int) -> None:
    from compress.runtime.hugepages import huge_page_zeros

    op = torch.ops.compress.stream_read_sum
    n = (mib << 20) // 8
    small = torch.ones(n, dtype=torch.int64)
    huge = huge_page_zeros((n,), torch.int64)
    if huge is None:
        print("# no madvise(MADV_HUGEPAGE) on this platform: nothing to compare")
        return
    huge.fill_(1)
    evict = torch.ones((256 << 20) // 8, dtype=torch.int64)
    times: dict[str, list[float]] = {"4 KiB pages": [], "2 MiB pages": []}
    for r in range(rounds):
        pairs = [("4 KiB pages", small), ("2 MiB pages", huge)]
        for name, buf in pairs if r % 2 == 0 else pairs[::-1]:
            op(evict)
            t0 = time.perf_counter()
            op(buf)
            times[name].append(time.perf_counter() - t0)
    for name, v in times.items():
        print(f"read {mib} MiB, {name}: median {(mib << 20) / statistics.median(v) / 1e9:.1f} GB/s")


def decode_ab(path: str, sequences: int, prompt_len: int, steps: int) -> None:
    import compress.runtime.kv_cache as kv_cache
    from compress.runtime.loading import open_checkpoint
    from compress.runtime.model_runner import ModelRunner
    from compress.runtime.models.llama import build_model

    models = {hp: build_model(open_checkpoint(path), huge_pages=hp) for hp in (False, True)}
    configs = [("weights 4 KiB, KV 4 KiB", False, False), ("weights 2 MiB, KV 4 KiB", True, False),
               ("weights 2 MiB, KV 2 MiB", True, True)]
    huge_zeros = kv_cache.huge_page_zeros
    prompt = [(7 * i) % 30000 + 5 for i in range(prompt_len)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for s in range(sequences):
        state = {}
        for name, hp_weights, hp_kv in configs:
            kv_cache.huge_page_zeros = huge_zeros if hp_kv else (lambda shape, dtype: None)
            try:
                runner = ModelRunner(models[hp_weights])
                state[name] = [runner, runner.prefill([prompt], prompt_len + steps + 1).argmax(-1)]
            finally:
                kv_cache.huge_page_zeros = huge_zeros
        for i in range(steps):
            for name, _, _ in configs if (i + s) % 2 == 0 else configs[::-1]:
                runner, tok = state[name]
                t0 = time.perf_counter()
                state[name][1] = runner.decode(tok).argmax(-1)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[configs[0][0]])
    for name, _, _ in configs:
        m = statistics.median(times[name])
        print(f"decode, {name}: median {m * 1e3:.2f} ms/token ({1 / m:.1f} tok/s), x{base / m:.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="a compress checkpoint")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sequences", type=int, default=6, help="prefills; each is followed by --steps decode steps")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--read-mib", type=int, default=256)
    p.add_argument("--read-rounds", type=int, default=10)
    args = p.parse_args(argv)
    import compress.ops  # noqa: F401  (defines torch.ops.compress)

    torch.set_num_threads(args.threads)
    read_ab(args.read_mib, args.read_rounds)
    decode_ab(args.path, args.sequences, args.prompt_len, args.steps)


if __name__ == "__main__":
    main()
