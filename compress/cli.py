"""The ``compress`` command line: run, eval, generate, inspect, lm-eval, bench, serve, methods."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from compress.w4_activations import DEFAULT_W4_ACTIVATIONS, W4_ACTIVATIONS
from compress.cli_args import positive_int


def _cmd_run(args) -> int:
    from compress.preflight import preflight
    from compress.recipe import load_recipe

    if args.ignore_memory_check:
        import os

        from compress.memory_estimate import IGNORE_ENV

        os.environ[IGNORE_ENV] = "1"
    recipe = load_recipe(args.recipe)
    notes = preflight(recipe)
    check_output_dir(Path(args.output) if args.output else Path(recipe.resolve(recipe.export.output)),
                     "--output" if args.output else f"{args.recipe}: export.output")
    if args.dry_run:
        for note in notes:
            print(f"{args.recipe}: {note}")
        print(f"{args.recipe}: OK — {len(recipe.stages)} stage(s): "
              + ", ".join(f"{s.name} [{' -> '.join(st.method for st in s.steps)}]" for s in recipe.stages))
        return 0
    from compress.pipeline import run_recipe

    result = run_recipe(recipe, Path(args.output) if args.output else None, evaluate=not args.no_eval,
                        progress=not args.quiet, threads=args.threads)
    if "report" in result:
        print(Path(result["report"]).read_text())
        print(f"report: {result['report']} (+ report.json)")
    # the exports and the report are written either way; a failed cell still fails the command
    return 1 if result.get("failed_cells") else 0


def check_output_dir(path: Path, where: str) -> None:
    """The output directory can be made and written: a ConfigError naming ``where`` when
    it, or a parent, is a file, or the nearest existing parent is not writable (before
    any stage runs, not after the first one)."""
    import os

    from compress.config import ConfigError

    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{p} is a file, not a directory", where)
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"{p} is not writable", where)
            return


def _cmd_eval(args) -> int:
    if args.bootstrap:
        from evals.bootstrap import bootstrap_command

        return bootstrap_command(args)
    from evals.backend import max_context
    from evals.eval_config import (EvalConfig, KLConfig, PerplexityConfig, SpeedConfig,
                                   check_eval_against_context)
    from evals.evaluate import evaluate_checkpoint
    from compress.io.files import atomic_write_text
    from evals.report import render_markdown

    from compress.errors import UserError

    # inputs checked before any evaluation runs (each would otherwise fail its cells late)
    from compress.io.checkpoint import _looks_like_hub_id

    for what, path in (("PATH", args.path), ("--base", args.base)):
        if path is not None and not Path(path, "config.json").is_file() and not (
                not Path(path).exists() and _looks_like_hub_id(str(path))):   # a hub id loads as before
            raise UserError(f"{what} {path}: " + ("no config.json: not a checkpoint directory" if Path(path).is_dir()
                                                  else "no such checkpoint directory"))
    if args.text and not Path(args.text).is_file():
        raise UserError(f"--text {args.text}: no such file")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}")
    if args.tasks:
        from evals.tasks import unknown_tasks

        unknown = unknown_tasks(list(args.tasks))
        if unknown:
            raise UserError(f"--tasks: lm-eval knows no task, group or tag {unknown}")
    ppl = PerplexityConfig(seq_len=args.seq_len)   # None: sized to the model's context
    if args.text:
        ppl.file = args.text
    kl = KLConfig(file=ppl.file, seq_len=args.seq_len) if args.base else None
    cfg = EvalConfig(perplexity=ppl, kl=kl, speed=None if args.no_speed else SpeedConfig(),
                     threads=args.threads, kernels=args.kernels, task_limit=args.limit,
                     tasks=args.tasks, w4_activations=args.w4_activations)
    for path in filter(None, (args.base, args.path)):
        if Path(path, "config.json").is_file():
            check_eval_against_context(cfg, max_context(path), where=f"{path}: eval")
    records, cache = [], {}
    if args.base:
        records.append(evaluate_checkpoint(args.base, cfg, cache, name="base"))
    records.append(evaluate_checkpoint(args.path, cfg, cache if args.base else None))
    print(render_markdown(records, title=f"compress eval: {args.path}"))
    if args.json:
        atomic_write_text(args.json, json.dumps(records if args.base else records[0], indent=2, default=str))
    failed = [f"{r['name']} {cell}" for r in records for cell in r.get("errors", {})]
    if failed:
        print(f"compress eval: {len(failed)} cell(s) could not be measured: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0


def add_speculative_arguments(parser) -> None:
    """``--draft`` and ``--num-speculative-tokens`` (``compress generate``, ``compress serve``)."""
    parser.add_argument("--draft", metavar="DRAFT",
                        help="speculative decoding (lossless): a draft checkpoint directory with the target's "
                             "tokenizer, or 'ngram' (prompt lookup, no model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                        help="tokens drafted per step with --draft (default 3)")


def speculative_option(args) -> dict | None:
    """The ``speculative=`` of ``LLM`` that ``--draft`` / ``--num-speculative-tokens`` ask
    for (None without ``--draft``); bad values are a ``UserError`` naming the option."""
    from compress.errors import UserError

    draft = getattr(args, "draft", None)
    k = getattr(args, "num_speculative_tokens", None)
    if draft is None:
        if k is not None:
            raise UserError("--num-speculative-tokens needs --draft (a draft checkpoint directory or 'ngram')")
        return None
    k = 3 if k is None else k
    if k < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1, got {k}")
    if draft == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if not Path(draft).is_dir():
        raise UserError(f"--draft: draft checkpoint directory not found: {draft} (give a checkpoint directory "
                        f"or 'ngram')")
    if not Path(draft, "config.json").is_file():
        raise UserError(f"--draft {draft}: no config.json (not a model directory)")
    return {"model": str(draft), "num_speculative_tokens": k}


def load_llm(llm_class, path, speculative: dict | None, **kwargs):
    """``llm_class(path, speculative=..., **kwargs)``; the runtime's own ``ValueError``s
    about the draft (a vocabulary that differs from the target's) become ``UserError``s."""
    from compress.errors import UserError

    if speculative is None:
        return llm_class(path, **kwargs)
    try:
        return llm_class(path, speculative=speculative, **kwargs)
    except UserError:   # a checkpoint error (no config.json, ...) names its directory already
        raise
    except ValueError as exc:
        if str(exc).startswith("speculative:"):
            raise UserError(f"--draft {speculative.get('model', 'ngram')}: {exc}") from exc
        raise


def speculative_summary(stats: dict) -> str:
    """One line of the acceptance figures in ``LLMEngine.stats()``."""
    rate, mean = stats.get("spec_acceptance_rate"), stats.get("spec_mean_tokens_per_row_step")
    return (f"--- speculative ({stats.get('spec_method')}, k={stats.get('spec_k')}): acceptance rate "
            f"{'n/a' if rate is None else f'{rate:.3f}'} ({stats.get('spec_accepted_tokens', 0)}/"
            f"{stats.get('spec_draft_tokens', 0)} draft tokens), mean tokens per step "
            f"{'n/a' if mean is None else f'{mean:.2f}'} over {stats.get('spec_rows', 0)} sequence-steps")


def _cmd_generate(args) -> int:
    from compress.errors import UserError
    from compress.runtime import LLM, SamplingParams

    try:  # before the model loads: a bad value is named at once, as its flag
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    except ValueError as exc:
        raise UserError(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                               str(exc))) from exc
    speculative = speculative_option(args)
    llm = load_llm(LLM, args.path, speculative, dtype=args.dtype, kernels=args.kernels, threads=args.threads,
                   device=args.device,
                   kv_cache_dtype=args.kv_cache_dtype, w4_activations=args.w4_activations)
    if args.w4_activations == "int8" and llm.w4_activations is None:
        print("compress generate: note: --w4-activations int8 has no effect: this model has no int4 layers",
              file=sys.stderr)
    try:
        if args.stream:
            for prompt in args.prompt:
                print(prompt, end="", flush=True)
                for delta in llm.stream(prompt, params):
                    print(delta, end="", flush=True)
                print()
        else:
            for out in llm.generate(args.prompt, params):
                print(out.prompt + out.text)
                print(f"--- {len(out.token_ids)} tokens, finish: {out.finish_reason}", file=sys.stderr)
    except ValueError as exc:   # a prompt the model cannot take (longer than its context, ...)
        if isinstance(exc, UserError):
            raise
        raise UserError(f"--prompt: {exc}") from None
    if speculative is not None:
        print(speculative_summary(llm.engine.stats()), file=sys.stderr)
    return 0


def _cmd_inspect(args) -> int:
    from compress.io.inspect import format_inspect, inspect_checkpoint

    info = inspect_checkpoint(args.path)
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspect(info))
    if info.get("verified") is False:   # a file's checksum differs from the manifest's: a script must see it
        print(f"compress inspect: {args.path}: checksums do not match the manifest", file=sys.stderr)
        return 1
    return 0


def _cmd_methods(_args) -> int:
    from compress.registry import METHODS

    for m in METHODS.values():
        print(f"{m.name:16s} {m.config_class.__name__:22s} {m.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from compress.dtypes import KV_CACHE_DTYPES   # torch, as the subcommands' parsers import it

    p = argparse.ArgumentParser(prog="compress", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a recipe: compress, export, evaluate, report")
    r.add_argument("recipe")
    r.add_argument("--output", "-o", help="output directory (default: the recipe's export.output)")
    r.add_argument("--dry-run", action="store_true", help="only validate the recipe")
    r.add_argument("--ignore-memory-check", action="store_true",
                   help="run even where the memory estimate (an upper bound) passes the memory available")
    r.add_argument("--no-eval", action="store_true", help="compress and export only")
    r.add_argument("--threads", type=positive_int, default=None)
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.set_defaults(func=_cmd_run)

    e = sub.add_parser("eval", help="evaluate a checkpoint (exported or plain Hugging Face)")
    e.add_argument("path")
    e.add_argument("--text", help="text file for perplexity (default: the shipped held-out pydoc text)")
    e.add_argument("--seq-len", type=int, default=None,
                   help="perplexity and KL window length (default: 512 and 256, or the model's context if shorter)")
    e.add_argument("--tasks", nargs="*", default=[],
                   help="lm-eval tasks (default: none; pydoc_cloze pydoc_ppl are the embedded model's)")
    e.add_argument("--limit", type=int, default=None, help="examples per task")
    e.add_argument("--base", help="a base checkpoint to compute KL divergence against")
    e.add_argument("--no-speed", action="store_true")
    e.add_argument("--threads", type=positive_int, default=None)
    e.add_argument("--kernels", choices=["native", "reference"], default="native")
    e.add_argument("--w4-activations", choices=W4_ACTIVATIONS, default=DEFAULT_W4_ACTIVATIONS,
                   help="activations of int4 (w4a16) layers: float, the scheme's numbers (default), or int8 per block "
                        "of 32, the CPU fast path (as llama.cpp; ~0.4%% off the logits)")
    e.add_argument("--json", help="also write the record to this file")
    e.add_argument("--bootstrap", nargs="+", metavar="OTHER",
                   help="instead of the evaluation: PATH's perplexity gap to --base as a share of each OTHER's, "
                        "on non-overlapping --seq-len windows of --text, with a bootstrap interval over the "
                        "windows (--kernels reference scores W4A16 exactly)")
    e.add_argument("--bootstrap-reps", type=int, default=2000, help="bootstrap resamplings")
    e.add_argument("--bootstrap-seed", type=int, default=0)
    e.add_argument("--bootstrap-level", type=float, default=0.9, help="the interval's coverage")
    e.set_defaults(func=_cmd_eval)

    g = sub.add_parser("generate", help="generate text with the bundled runtime")
    g.add_argument("path")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's: > 1 discourages the prompt's and output's tokens (1: off)")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: CUDA kernels and decode graphs; wants --dtype float16 or bfloat16)")
    g.add_argument("--kv-cache-dtype", default=None, choices=["model", *KV_CACHE_DTYPES],
                   help="the KV cache's element type: float16 / bfloat16 halve its bytes, int8 with a scale a row "
                        "quarters float32's; default: --dtype, exact")
    g.add_argument("--kernels", choices=["native", "reference"], default="native")
    g.add_argument("--w4-activations", choices=W4_ACTIVATIONS, default=DEFAULT_W4_ACTIVATIONS,
                   help="activations of int4 (w4a16) layers: float, the scheme's numbers (default), or int8 per block "
                        "of 32, the CPU fast path (as llama.cpp; ~0.4%% off the logits)")
    g.add_argument("--threads", type=positive_int, default=None)
    add_speculative_arguments(g)
    g.set_defaults(func=_cmd_generate)

    i = sub.add_parser("inspect", help="what a checkpoint holds: schemes per layer, size, checksums")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    sub.add_parser("methods", help="list the registered recipe methods").set_defaults(func=_cmd_methods)

    # lm-eval's own CLI with our model registered; every argument passed through unchanged
    sub.add_parser("lm-eval", help="lm-eval's CLI with --model compress registered", add_help=False)

    from compress.bench import add_bench_parser

    add_bench_parser(sub)

    from compress.serve.cli import add_serve_parser

    add_serve_parser(sub)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is so that every ``with`` block on the way
    out (an export's temporary directory, a report's temporary file) cleans up."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    import signal

    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    from compress.errors import UserError

    # (compress serve puts its own SIGTERM handling in place while it serves: a drain)
    # not for serve: it drains on SIGTERM once it listens, and while its model loads on
    # another thread the default action (exit) is cleaner than an exception in a join
    previous = signal.signal(signal.SIGTERM, _raise_terminated) \
        if threading_is_main() and command != "serve" else None
    try:
        if command == "lm-eval":
            from evals.lm_eval_cli import main as lm_eval_main

            return lm_eval_main(argv[1:]) or 0
        args = build_parser().parse_args(argv)
        return args.func(args) or 0
    except KeyboardInterrupt as exc:   # Ctrl-C or SIGTERM: what was being written is gone, the rest intact
        print(f"compress {command}: interrupted", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except (UserError, OSError) as exc:   # OSError: a path that is a file, not writable, not there
        print(f"compress {command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
