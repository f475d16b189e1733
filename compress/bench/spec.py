"""``compress bench spec``: speculative decoding on our runtime, measured against the
prediction (issue 24).

For each draft (a checkpoint with the target's tokenizer, or ``ngram``: prompt lookup)
and each k: the acceptance rate α (accepted / proposed draft tokens), the mean accepted
length per verify, c (a draft step's time over a target decode step's), v(k) (a
(k+1)-token verify pass over a target decode step), the predicted speedup
(1 - α^(k+1)) / (1 - α) / (k·c + v), and the measured greedy decode tok/s of the
target with the speculative step over the target alone -- the same engine and prompts
(windows of ``data/pydoc/eval.txt``) in the same process, alternating A B A B, medians --
at each ``--batch``; the speculative outputs must equal the target's (printed, in the
JSON). Peer (``--assistant``, batch 1): transformers' ``generate(assistant_model=...)``
against plain ``generate`` on the HF-format target (a float draft: the int4
compressed-tensors exports are for our runtime). ``--bench-model DIR``: v(k) of another
checkpoint (the 345M bench model, where decode is bound by memory) and the speedup the
embedded pair's α and c would give there.

    compress run examples/speculative.yaml
    compress bench spec --draft out/speculative/depth-int4 --draft out/speculative/width-int4 --draft ngram \\
        --assistant out/speculative/depth-kd --json out/bench-spec.json
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from compress.bench.spec_timing import expected_tokens, pass_costs, predicted_speedup
from compress.errors import UserError
from compress.io.files import atomic_write_text
from evals.decode_runs import DecodeRun, decode_run, prompt_windows
from compress.cli_args import positive_int

REPO = Path(__file__).resolve().parents[2]
EMBEDDED_MODEL = REPO / "models" / "pydoc-llama"
EVAL_TEXT = REPO / "data" / "pydoc" / "eval.txt"
EXAMPLE_OUT = REPO / "out" / "speculative"       # what examples/speculative.yaml writes
DEFAULT_DRAFTS = ("depth-int4", "width-int4")
DEFAULT_ASSISTANTS = ("depth-kd", "width-kd")               # float stages: transformers loads them
SPEC_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_emitted_tokens", "spec_rows", "spec_steps",
               "spec_rejections")


class SpecBenchError(UserError):
    """A bench option that cannot work (names the option)."""


def _defaults(out: Path, names) -> list[str]:
    """The stages of ``out`` named ``names`` that have been made."""
    return [str(out / n) for n in names if (out / n / "config.json").exists()]


def _drafter(llm, draft: str):
    """``(drafter, draft LLM or None)``: prompt lookup, or the draft checkpoint loaded like
    the target (same dtype and kernels) with its own paged cache of the target's size."""
    from compress.runtime.engine import LLM
    from compress.runtime.speculative import ModelDrafter, NgramDrafter

    if draft == "ngram":
        return NgramDrafter(), None
    draft_llm = LLM(draft, dtype=llm.dtype, kernels=llm.kernels, max_seq_len=llm.max_seq_len,
                    max_batch_size=llm.engine.scheduler.max_num_seqs)
    try:
        drafter = ModelDrafter.for_target(draft_llm.model, llm.engine, llm.engine.runner.native is not None, draft)
    except ValueError as exc:
        raise SpecBenchError(f"--draft {draft}: {exc}") from None
    return drafter, draft_llm


def _groups(windows: list, batch: int) -> list[list]:
    """The windows in batches of ``batch`` (every batch size decodes the same windows)."""
    n = max(len(windows) // batch, 1)
    return [windows[i * batch:(i + 1) * batch] for i in range(n)]


def _run_all(llm, groups, new_tokens: int, make_decoder=None) -> DecodeRun:
    """Every group decoded in turn, summed into one run."""
    tokens, n, seconds, spec = [], 0, 0.0, None
    for g in groups:
        r = decode_run(llm, g, new_tokens, None if make_decoder is None else make_decoder())
        tokens += r.token_ids
        n += r.decode_tokens
        seconds += r.seconds
        if r.spec is not None:
            spec = {f: (spec or {}).get(f, 0) + r.spec[f] for f in SPEC_FIELDS}
    return DecodeRun(tokens, n, seconds, spec)


def measure_draft(llm, draft: str, windows, args, target_costs: dict, log=print) -> list[dict]:
    """One record per (batch, k) of ``draft``: α, accepted length, c, v, predicted and
    measured speedup, and whether the outputs equal the target alone's."""
    from compress.runtime.speculative import SpeculativeDecoder   # a fresh one per run: its counters start at 0

    drafter, draft_llm = _drafter(llm, draft)
    records = []
    for b in args.batch:
        groups = _groups(windows, b)
        step_s = target_costs[b]["step_s"]
        draft_s = pass_costs(draft_llm, windows[:b], [], args.timing_repeats)["step_s"] if draft_llm else 0.0
        c = draft_s / step_s     # ngram: a lookup in the sequence's own tokens, no model pass
        for k in args.k:
            plain, spec, ratios, identical = [], [], [], True
            counters = {}
            base_forwards = getattr(drafter, "forwards", 0)
            for _ in range(args.repeats):
                a = _run_all(llm, groups, args.new_tokens)
                s = _run_all(llm, groups, args.new_tokens, lambda: SpeculativeDecoder(drafter, k))
                plain.append(a.tok_s)
                spec.append(s.tok_s)
                ratios.append(s.tok_s / a.tok_s)
                identical &= s.token_ids == a.token_ids
                for f, val in s.spec.items():
                    counters[f] = counters.get(f, 0) + val
                counters["seconds"] = counters.get("seconds", 0.0) + s.seconds
            counters["draft_forwards"] = getattr(drafter, "forwards", 0) - base_forwards
            proposed, accepted = counters["spec_draft_tokens"], counters["spec_accepted_tokens"]
            alpha = accepted / proposed if proposed else 0.0
            judged = accepted + counters["spec_rejections"]     # tokens after a rejection are never judged
            alpha_token = accepted / judged if judged else 0.0
            rows, steps = counters["spec_rows"], counters["spec_steps"]
            v = target_costs[b]["verify_s"][k] / step_s
            # where a speculative step's time goes: its passes (draft passes as counted, one verify) and the rest
            step_ms = counters["seconds"] / steps * 1e3 if steps else 0.0
            passes_ms = ((counters["draft_forwards"] / steps if steps else 0.0) * draft_s
                         + target_costs[b]["verify_s"][k]) * 1e3
            rec = {"draft": draft, "k": k, "batch": b, "alpha": alpha, "alpha_token": alpha_token,
                   "mean_accepted": accepted / rows if rows else 0.0,
                   "tokens_per_pass": counters["spec_emitted_tokens"] / rows if rows else 0.0,
                   "proposed_per_row": proposed / rows if rows else 0.0,
                   "expected_tokens": expected_tokens(alpha_token, k), "c": c, "v": v,
                   "predicted_speedup": predicted_speedup(alpha_token, k, c, v),
                   "predicted_speedup_alpha": predicted_speedup(alpha, k, c, v),
                   "target_step_ms": step_s * 1e3, "spec_step_ms": step_ms, "spec_passes_ms": passes_ms,
                   "spec_overhead_ms": step_ms - passes_ms,
                   "target_tok_s": statistics.median(plain), "spec_tok_s": statistics.median(spec),
                   "measured_speedup": statistics.median(ratios), "identical": identical,
                   "target_rounds": plain, "spec_rounds": spec, "counters": counters}
            log(row_line(rec))
            if not identical:
                log(f"# WARNING: {draft} k={k} batch {b}: speculative greedy outputs differ from the target alone's")
            records.append(rec)
    return records


def bench_model_costs(path: str, windows, args, records: list[dict], log=print) -> list[dict]:
    """v(k) of another checkpoint at each batch, and the speedup each embedded draft's α and
    c (a draft of the same relative cost) would give with it."""
    from compress.runtime.engine import LLM

    llm = LLM(path, max_batch_size=max(args.batch))
    vocab = llm.model.vocab_size
    rows = [[t % vocab for t in w] for w in windows]       # timing only: the ids' meaning does not matter
    out = []
    for b in args.batch:
        costs = pass_costs(llm, rows[:b], args.k, args.bench_model_repeats)
        for k in args.k:
            v = costs["verify_s"][k] / costs["step_s"]
            preds = {r["draft"]: {"alpha": r["alpha"], "c": r["c"],
                                  "predicted_speedup": predicted_speedup(r["alpha"], k, r["c"], v)}
                     for r in records if r["k"] == k and r["batch"] == b}
            rec = {"model": str(path), "batch": b, "k": k, "step_ms": costs["step_s"] * 1e3,
                   "verify_ms": costs["verify_s"][k] * 1e3, "v": v, "predicted": preds}
            log(f"# {Path(path).name} batch {b} k={k}: step {rec['step_ms']:.2f} ms, verify {rec['verify_ms']:.2f} ms, "
                f"v={v:.2f}; predicted " + ", ".join(f"{Path(d).name} {p['predicted_speedup']:.2f}x"
                                                    for d, p in preds.items()))
            out.append(rec)
    return out


HEADER = ("| draft | k | batch | α | α/token | accepted/verify | tokens/pass (expected) | c | v(k) | predicted | "
          "target tok/s | spec tok/s | measured | step ms: passes + rest | identical |")


def row_line(r: dict) -> str:
    return (f"| {Path(r['draft']).name} | {r['k']} | {r['batch']} | {r['alpha']:.3f} | {r['alpha_token']:.3f} | "
            f"{r['mean_accepted']:.2f} | {r['tokens_per_pass']:.2f} ({r['expected_tokens']:.2f}) | {r['c']:.3f} | "
            f"{r['v']:.2f} | {r['predicted_speedup']:.2f}x | {r['target_tok_s']:.0f} | {r['spec_tok_s']:.0f} | "
            f"{r['measured_speedup']:.2f}x | {r['spec_passes_ms']:.2f} + {r['spec_overhead_ms']:.2f} | "
            f"{'yes' if r['identical'] else 'NO'} |")


def table(records: list[dict]) -> list[str]:
    return [HEADER, "|" + "---|" * (HEADER.count("|") - 1)] + [row_line(r) for r in records]


def summary(records: list[dict], goal: float = 1.5) -> list[str]:
    lines = []
    for draft in dict.fromkeys(r["draft"] for r in records):
        mine = [r for r in records if r["draft"] == draft]
        paying = [b for b in dict.fromkeys(r["batch"] for r in mine)
                  if max(r["measured_speedup"] for r in mine if r["batch"] == b) > 1.0]
        lines.append(f"# {Path(draft).name}: speculation pays (best k > 1.0x) at batch "
                     f"{', '.join(map(str, paying)) or 'none'}")
    model_drafts = [r for r in records if r["batch"] == 1 and r["draft"] != "ngram"]
    if model_drafts:
        best = max(model_drafts, key=lambda r: r["measured_speedup"])
        verdict = "met" if best["measured_speedup"] >= goal else "not met"
        lines.append(f"# goal: greedy decode >= {goal}x the target alone at batch 1 with the best draft model: "
                     f"{Path(best['draft']).name} k={best['k']} {best['measured_speedup']:.2f}x -- {verdict}")
    return lines


def run(args, log=print) -> dict:
    from compress.runtime.engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    drafts = args.draft if args.draft is not None else _defaults(EXAMPLE_OUT, DEFAULT_DRAFTS) + ["ngram"]
    assistants = args.assistant if args.assistant is not None else (
        _defaults(EXAMPLE_OUT, DEFAULT_ASSISTANTS) if args.target == str(EMBEDDED_MODEL) else [])
    for d in drafts:
        if d != "ngram" and not (Path(d) / "config.json").exists():
            raise SpecBenchError(f"--draft {d}: no checkpoint there (make the drafts with "
                                 f"`compress run examples/speculative.yaml`, or pass 'ngram')")
    llm = LLM(args.target, max_batch_size=max(args.batch))
    windows = prompt_windows(llm, Path(args.prompts), max(max(args.batch), args.min_prompts), args.prompt_len)
    log(f"# target {args.target}; {len(windows)} prompt windows of {args.prompt_len} tokens from {args.prompts}; "
        f"{args.new_tokens} new tokens each, greedy; threads {torch.get_num_threads()}; repeats {args.repeats}")
    target_costs = {b: pass_costs(llm, windows[:b], args.k, args.timing_repeats) for b in args.batch}
    for b, cst in target_costs.items():
        log(f"# target batch {b}: decode pass {cst['step_s'] * 1e3:.3f} ms; verify " +
            ", ".join(f"k={k} {s * 1e3:.3f} ms" for k, s in cst["verify_s"].items()))
    log(HEADER)
    log("|" + "---|" * (HEADER.count("|") - 1))
    records = []
    for draft in drafts:
        records += measure_draft(llm, draft, windows, args, target_costs, log)
    peer = []
    if 1 in args.batch and assistants and not args.no_peer:
        from compress.bench.spec_peer import assisted_peer
        for a in assistants:
            peer += assisted_peer(Path(args.target), Path(a), windows[:args.peer_prompts], args.new_tokens, args.k,
                                  args.repeats, log)
    bench = [rec for path in args.bench_model or [] for rec in bench_model_costs(path, windows, args, records, log)]
    lines = summary(records)
    for line in lines:
        log(line)
    result = {"target": str(args.target), "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
              "prompt_len": args.prompt_len, "prompts": str(args.prompts), "windows": len(windows),
              "repeats": args.repeats,
              "target_costs": {str(b): {"step_ms": c["step_s"] * 1e3,
                                        "verify_ms": {str(k): s * 1e3 for k, s in c["verify_s"].items()}}
                               for b, c in target_costs.items()},
              "records": records, "transformers_assisted": peer, "bench_model": bench, "summary": lines,
              "identical": all(r["identical"] for r in records)}
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=2))
        log(f"# wrote {args.json}")
    return result


def main(args) -> int:
    result = run(args)
    return 0 if result["identical"] else 1


def add_arguments(p) -> None:
    p.add_argument("--target", default=str(EMBEDDED_MODEL), help="the target checkpoint (default: the embedded model)")
    p.add_argument("--draft", action="append", default=None,
                   help="a draft checkpoint dir or 'ngram' (repeatable; default: out/speculative/depth-int4 and "
                        "width-int4 where made, and ngram)")
    p.add_argument("--assistant", action="append", default=None,
                   help="a float draft transformers loads, for the assisted-generation peer at batch 1 "
                        "(repeatable; default with the embedded target: out/speculative/depth-kd and width-kd where made)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' assisted generation")
    p.add_argument("--k", type=int, nargs="+", default=[1, 3, 5], help="draft tokens per step")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="rows decoded together")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prompts", default=str(EVAL_TEXT), help="text the prompt windows are taken from")
    p.add_argument("--min-prompts", type=int, default=4,
                   help="windows decoded at every batch size (at least the largest --batch)")
    p.add_argument("--peer-prompts", type=int, default=4, help="windows of the transformers peer")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="A B rounds (medians)")
    p.add_argument("--timing-repeats", type=int, default=30, help="passes timed for c and v (medians)")
    p.add_argument("--bench-model", action="append", default=None,
                   help="also time v(k) on this checkpoint (e.g. out/bench-llama/rtn-int4; repeatable) and give the "
                        "speedup the embedded drafts' α and c predict there")
    p.add_argument("--bench-model-repeats", type=int, default=5, help="passes timed on --bench-model (medians)")
    p.add_argument("--json", default=None)
