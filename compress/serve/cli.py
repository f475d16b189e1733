"""``compress serve [PATH]``: the OpenAI-compatible HTTP server over the runtime's engine."""
from __future__ import annotations

import argparse
import gc
import inspect
import logging
import os
import time
from pathlib import Path

from compress.dtypes import KV_CACHE_DTYPES
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS, W4_ACTIVATIONS
from compress.cli_args import positive_int

EMBEDDED_MODEL = Path(__file__).resolve().parents[2] / "models" / "pydoc-llama"

# command-line option -> LLM keyword (given only when set, so the runtime's defaults apply)
RUNTIME_OPTIONS = {
    "dtype": "dtype", "kernels": "kernels", "threads": "threads", "max_seq_len": "max_seq_len",
    "max_num_seqs": "max_batch_size", "kv_cache_tokens": "kv_cache_tokens", "block_size": "block_size",
    "max_num_batched_tokens": "max_num_batched_tokens", "kv_cache_dtype": "kv_cache_dtype",
    "w4_activations": "w4_activations", "enable_chunked_prefill": "enable_chunked_prefill",
    "enable_prefix_caching": "enable_prefix_caching",
    "max_prefill_tokens_with_decodes": "max_prefill_tokens_with_decodes",
    "device": "device", "cuda_graphs": "cuda_graphs", "max_itl_ratio": "max_itl_ratio",
}


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, tokenizer, metrics)",
                       description=__doc__)
    s.add_argument("path", nargs="?", default=str(EMBEDDED_MODEL),
                   help="checkpoint directory (default: the embedded model, models/pydoc-llama)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default 8000; 0: any free one, named in the line printed when it is ready)")
    s.add_argument("--api-key", default=os.environ.get("COMPRESS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $COMPRESS_API_KEY, else none)")
    s.add_argument("--served-model-name", help="the model's name in the API (default: the directory's name)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="sequences that may wait beyond those running; more get 503 + Retry-After")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take before it is aborted (504); 0: no limit")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish before they are aborted")
    s.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: temperature / top_p / top_k / repetition_penalty that a request leaves out come from "
                        "the model's generation_config.json where it sets them (as vLLM's); none: OpenAI's defaults")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--step-log", metavar="FILE",
                   help="record every engine step (end time, forward seconds, decode rows, prompt tokens) and write "
                        "them to FILE as tab-separated lines when the server stops, with a summary on stdout")
    r = s.add_argument_group("runtime")
    r.add_argument("--threads", type=positive_int, default=None)
    r.add_argument("--max-num-seqs", type=int, default=16, help="sequences the engine runs at once")
    r.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens (all sequences)")
    r.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block")
    r.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step")
    r.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", default=None)
    r.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                   help="prompt tokens a step that also decodes may take (default: no cap but "
                        "--max-num-batched-tokens): smaller keeps running requests' inter-token gaps short while a "
                        "long prompt comes in, at some prefill throughput")
    r.add_argument("--max-itl-ratio", type=float, default=None,
                   help="instead of a fixed --max-prefill-tokens-with-decodes, size that cap from the measured step "
                        "times so that a step with prompt chunks takes about this many times a decode-only step "
                        "(e.g. 1.3; runtime/prefill_cap.py)")
    r.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    r.add_argument("--max-seq-len", type=int, default=None, help="context length (default: the model's)")
    r.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the model runs (default cpu; cuda wants --dtype float16 or bfloat16)")
    r.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="on a GPU, launch every decode step's kernels instead of replaying CUDA graphs")
    r.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    r.add_argument("--kv-cache-dtype", default=None, choices=["model", *KV_CACHE_DTYPES],
                   help="K / V cache element type (default: --dtype); int8: a scale a row")
    r.add_argument("--kernels", default=None, choices=["native", "reference"])
    r.add_argument("--w4-activations", default=None, choices=W4_ACTIVATIONS,
                   help=f"activations of int4 layers (default {DEFAULT_W4_ACTIVATIONS})")
    from compress.cli import add_speculative_arguments

    add_speculative_arguments(r)
    s.set_defaults(func=_cmd_serve)


def llm_kwargs(args, llm_class) -> dict:
    """The runtime options that were given, checked against ``llm_class``'s constructor
    (``--draft`` / ``--num-speculative-tokens``: its ``speculative``)."""
    from compress.cli import speculative_option
    from compress.errors import UserError

    accepted = inspect.signature(llm_class.__init__).parameters
    kwargs = {}
    for option, keyword in RUNTIME_OPTIONS.items():
        value = getattr(args, option, None)
        if value is None:
            continue
        if keyword not in accepted:
            raise UserError(f"--{option.replace('_', '-')}: this runtime's LLM has no option {keyword!r}")
        kwargs[keyword] = value
    speculative = speculative_option(args)
    if speculative is not None:
        if "speculative" not in accepted:
            raise UserError("--draft: this runtime's LLM has no option 'speculative'")
        kwargs["speculative"] = speculative
    return kwargs


def build_llm(args, llm_class=None):
    """The ``LLM`` ``compress serve`` serves, from its parsed arguments."""
    from compress.cli import load_llm

    if llm_class is None:
        from compress.runtime import LLM as llm_class
    kwargs = llm_kwargs(args, llm_class)
    return load_llm(llm_class, args.path, kwargs.pop("speculative", None), **kwargs)


def freeze_loaded_objects() -> int:
    """Moves every object alive now (the model, its modules and tensors, the tokenizer) out
    of the garbage collector's reach (``gc.freeze``), so that the full collections a server
    runs now and then no longer walk them: under the long-prompt workload one such
    collection had stalled the engine thread 157 ms (1.7 ms once frozen). Returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _load_and_prefault(args):
    llm = build_llm(args)
    cache = llm.engine.kv_cache
    t0 = time.perf_counter()
    cache.prefault()   # page faults now, not inside a step under load
    print(f"compress serve: KV cache {cache.num_blocks} blocks of {cache.block_size} tokens, "
          f"{cache.nbytes / 2**30:.2f} GiB ({str(cache.dtype)[6:]}), touched in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return llm


def _cmd_serve(args) -> int:
    from compress.errors import UserError

    for name in ("port", "max_queue", "max_num_seqs"):
        if getattr(args, name) < 0 or (name == "max_num_seqs" and args.max_num_seqs < 1):
            raise UserError(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'max_num_seqs' else '>= 0'}")
    if args.max_prefill_tokens_with_decodes is not None and args.max_prefill_tokens_with_decodes < 1:
        raise UserError("--max-prefill-tokens-with-decodes must be >= 1")
    if args.max_itl_ratio is not None:
        if not 1.0 < args.max_itl_ratio < float("inf"):
            raise UserError(f"--max-itl-ratio must be a number > 1 (a step with prompt chunks over a decode step), "
                            f"got {args.max_itl_ratio}")
        if args.max_prefill_tokens_with_decodes is not None:
            raise UserError("--max-itl-ratio sizes the cap that --max-prefill-tokens-with-decodes fixes: give one")
    if not Path(args.path).is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {args.path}")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from compress.serve.server import listen_socket, listening_line, serve, socket_url
    from compress.serve.state import ServeConfig, default_model_name

    from compress.runtime.threads import run_on_fresh_thread

    # bound before the model loads: a port in use fails at once, and port 0 gets a free one,
    # printed below once the server is about to listen
    sock = listen_socket(args.host, args.port)
    # loaded on a thread that exits: the engine's thread is then the only one with an
    # OpenMP pool (runtime/threads.py: two pools made every op wait for its workers)
    llm = run_on_fresh_thread(_load_and_prefault, args)
    freeze_loaded_objects()
    config = ServeConfig(model_name=args.served_model_name or default_model_name(args.path),
                         api_key=args.api_key or None, max_queue=args.max_queue,
                         max_num_seqs=args.max_num_seqs,
                         request_timeout=args.request_timeout or None,
                         sampling_defaults=llm.default_sampling_fields() if args.generation_config == "auto" else {})
    spec = getattr(llm, "speculative", None)
    spec_note = "" if spec is None else f" (speculative: {args.draft}, k={spec.num_speculative_tokens})"
    if args.w4_activations == "int8" and getattr(llm, "w4_activations", None) is None:
        print("note: --w4-activations int8 has no effect: this model has no int4 layers", flush=True)
    if config.sampling_defaults:
        print("sampling defaults from the model's generation_config.json (a request's own values win; "
              f"--generation-config none: OpenAI's): {config.sampling_defaults}", flush=True)
        penalty = config.sampling_defaults.get("repetition_penalty", 1.0)
        if spec is not None and penalty != 1.0:
            print(f"note: that repetition_penalty {penalty} makes every request that does not name its own run "
                  "without speculative decoding (a penalized step does not speculate); send repetition_penalty 1, "
                  "or serve with --generation-config none", flush=True)
    print(listening_line(config.model_name, args.path, socket_url(sock),
                         f"{' (API key required)' if config.api_key else ''}{spec_note}"), flush=True)
    if args.step_log:
        from compress.runtime.step_log import StepLog

        llm.engine.step_log = StepLog()
    rc = serve(llm, config, sock, shutdown_grace=args.shutdown_grace, log_level=args.log_level)
    if args.step_log:
        write_step_log(llm.engine.step_log, args.step_log)
    return rc


def write_step_log(log, path) -> None:
    """``log`` (a ``StepLog``) to ``path`` (written whole, then renamed) and its summary to stdout."""
    from compress.io.files import atomic_write_text

    atomic_write_text(path, log.text())
    print("\n".join([f"compress serve: step log {path}"] + log.summary_lines()), flush=True)
