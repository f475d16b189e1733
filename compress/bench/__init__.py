"""Benchmarks: ``compress bench kernels`` (our CPU kernels against PyTorch and
bitsandbytes, beside the measured DRAM bandwidth) and ``compress bench model PATH``
(prefill / decode tokens/s of a checkpoint on our runtime, llama.cpp and transformers);
``bench cuda`` (the CUDA kernels against cuBLAS and the roofline), ``bench profile
CKPT`` (a decode step's time by op group), ``bench make-model`` (the benchmark model
and its int4 / int8 exports) and ``bench outlier-model`` (a copy of a model with
outlier features, same function).

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

    from compress.bench import cuda, make_model, outlier_model, profile  # light imports: torch only

    pc = sub.add_parser("cuda", help="CUDA kernels vs cuBLAS fp16, PyTorch's int4 kernel and the roofline (GPU)")
    cuda.add_arguments(pc)
    pc.set_defaults(func=cuda.main, handler=cuda.main)

    pp = sub.add_parser("profile", help="where a checkpoint's decode step spends its time, by op group")
    profile.add_arguments(pp)
    pp.set_defaults(func=profile.main, handler=profile.main)

    pmm = sub.add_parser("make-model", help="the random-init benchmark Llama (HF dir) and its RTN int4 / int8 exports")
    make_model.add_arguments(pmm)
    pmm.set_defaults(func=make_model.main, handler=make_model.main)

    po = sub.add_parser("outlier-model", help="a copy of a Llama-family model with outlier feature dimensions "
                                              "(same outputs)")
    outlier_model.add_arguments(po)
    po.set_defaults(func=outlier_model.main, handler=outlier_model.main)

    from compress.bench import llamacpp

    pl = sub.add_parser("llamacpp", help="build llama.cpp's llama-bench / llama-batched-bench / llama-quantize "
                                         "for this CPU (the baseline of `bench model`)")
    llamacpp.add_arguments(pl)
    pl.set_defaults(func=llamacpp.main, handler=llamacpp.main)
