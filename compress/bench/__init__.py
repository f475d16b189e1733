"""Benchmarks: ``compress bench kernels`` (our CPU kernels against PyTorch and
bitsandbytes, beside the measured DRAM bandwidth) and ``compress bench model PATH``
(prefill / decode tokens/s of a checkpoint on our runtime, llama.cpp and transformers).

``add_bench_parser(subparsers)`` registers the ``bench`` subcommand on the CLI."""
from __future__ import annotations


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark the kernels or a model (prints medians and ratios)")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    from compress.bench import kernels, model  # light imports: torch only

    pk = sub.add_parser("kernels", help="W4A16 / W8A8 / LLM.int8 kernels vs PyTorch and bitsandbytes")
    kernels.add_arguments(pk)
    pk.set_defaults(func=kernels.main, handler=kernels.main)

    pm = sub.add_parser("model", help="prefill / decode tokens/s of a checkpoint vs llama.cpp and transformers")
    model.add_arguments(pm)
    pm.set_defaults(func=model.main, handler=model.main)

    from compress.bench import llamacpp

    pl = sub.add_parser("llamacpp", help="build llama.cpp's llama-bench / llama-batched-bench / llama-quantize "
                                         "for this CPU (the baseline of `bench model`)")
    llamacpp.add_arguments(pl)
    pl.set_defaults(func=llamacpp.main, handler=llamacpp.main)
