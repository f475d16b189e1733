"""Benchmarks: ``compress bench kernels`` (our CPU kernels against PyTorch and
bitsandbytes, beside the measured DRAM bandwidth) and ``compress bench model PATH``
(prefill / decode tokens/s of a checkpoint on our runtime, llama.cpp and transformers);
``bench serve`` (TTFT / TPOT / ITL / throughput of OpenAI-compatible servers under load:
ours, ours one request at a time, llama.cpp's llama-server), ``bench cuda`` (the CUDA
kernels against cuBLAS and the roofline), ``bench profile CKPT`` (a decode step's time
by op group), ``bench make-model`` (the benchmark model and its int4 / int8 exports),
``bench outlier-model`` (a copy of a model with outlier features, same function) and
``bench spec`` (speculative decoding: acceptance, costs, predicted vs measured speedup).

``add_bench_parser(subparsers)`` registers the ``bench`` subcommand on the CLI."""
from __future__ import annotations


# subcommand -> (module in compress.bench with add_arguments(parser) and main(args), help)
SUBCOMMANDS = {
    "kernels": ("kernels", "W4A16 / W8A8 / LLM.int8 kernels vs PyTorch and bitsandbytes"),
    "model": ("model", "prefill / decode tokens/s of a checkpoint vs llama.cpp and transformers"),
    "cuda": ("cuda", "CUDA kernels vs cuBLAS fp16, PyTorch's int4 kernel and the roofline (GPU)"),
    "profile": ("profile", "where a checkpoint's decode step spends its time, by op group"),
    "make-model": ("make_model", "the random-init benchmark Llama (HF dir) and its RTN int4 / int8 exports"),
    "outlier-model": ("outlier_model", "a copy of a Llama-family model with outlier feature dimensions "
                                       "(same outputs)"),
    "llamacpp": ("llamacpp", "build llama.cpp's llama-bench / llama-batched-bench / llama-quantize / "
                             "llama-server for this CPU (the baseline of `bench model` and `bench serve`)"),
    "serve": ("serve.command", "serving benchmark (vllm bench serve's figures): our server, one request at a "
                               "time, and llama-server on seeded workloads"),
    "minitron": ("minitron", "issue 22's experiment: importance pruning + KD healing against random pruning and "
                             "training from scratch on the embedded model"),
    "spec": ("spec", "speculative decoding (issue 24): per draft and k, acceptance, draft / verify cost, predicted "
                     "and measured speedup over the target alone; transformers' assisted generation"),
}


def add_bench_parser(subparsers) -> None:
    import importlib

    bench = subparsers.add_parser("bench", help="benchmark the kernels or a model (prints medians and ratios)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(f"compress.bench.{module_name}")  # light imports: torch only
        parser = sub.add_parser(name, help=help_text)
        module.add_arguments(parser)
        parser.set_defaults(func=module.main)
