"""``GET /metrics``: the server's counters in Prometheus' text format (version 0.0.4).

Engine figures come from the engine thread's last published snapshot (running and
waiting sequences, KV blocks in use and in all); the HTTP side adds requests answered by
route and status, requests in flight, the queue (sequences admitted but not running),
rejections, timeouts, disconnects, tokens generated and the generation rate over the
last 10 seconds. With speculative decoding on (``--draft``), the engine's numeric
``spec_*`` and ``draft_*`` figures follow as ``compress_spec_*`` / ``compress_draft_*``.
"""
from __future__ import annotations

PREFIX = "compress"

# engine stats key -> (metric name, kind, help); numeric spec_* / draft_* keys not listed
# here are exported as gauges under their own name
SPEC_METRICS = {
    "spec_k": ("spec_num_speculative_tokens", "gauge", "Tokens drafted per sequence-step at most (k)."),
    "spec_steps": ("spec_steps_total", "counter", "Engine steps that ran speculatively."),
    "spec_rows": ("spec_rows_total", "counter", "Sequence-steps among the speculative steps."),
    "spec_draft_tokens": ("spec_draft_tokens_total", "counter", "Draft tokens proposed."),
    "spec_accepted_tokens": ("spec_accepted_tokens_total", "counter", "Draft tokens the target accepted."),
    "spec_emitted_tokens": ("spec_emitted_tokens_total", "counter",
                            "Tokens appended by speculative steps (accepted plus one recovered or bonus)."),
    "spec_acceptance_rate": ("spec_acceptance_rate", "gauge", "Accepted draft tokens / draft tokens."),
    "spec_rejections": ("spec_rejections_total", "counter", "Sequence-steps whose draft the target cut short."),
    "spec_acceptance_per_token": ("spec_acceptance_per_token", "gauge",
                                  "Accepted / (accepted + rejections): the chance a judged draft token is kept."),
    "spec_mean_tokens_per_row_step": ("spec_mean_tokens_per_row_step", "gauge",
                                      "Tokens appended per sequence-step of the speculative steps."),
    "draft_forwards": ("draft_forwards_total", "counter", "Forward passes of the draft model."),
    "draft_kv_blocks_used": ("draft_kv_blocks_used", "gauge", "The draft model's KV cache blocks in use."),
}


def _line(name: str, kind: str, help_text: str, samples) -> list[str]:
    out = [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"]
    for labels, value in samples:
        label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{PREFIX}_{name}{label} {float(value):g}" if isinstance(value, float)
                   else f"{PREFIX}_{name}{label} {int(value)}")
    return out


def render_metrics(state) -> str:
    stats = dict(state.engine_loop.stats)
    running = int(stats.get("running", 0))
    waiting = int(stats.get("waiting", 0))
    lines: list[str] = []
    lines += _line("requests_total", "counter", "HTTP requests answered, by route and status.",
                   [({"route": route, "status": str(status)}, n)
                    for (route, status), n in sorted(state.requests.items())] or [({}, 0)])
    lines += _line("requests_in_flight", "gauge", "Sequences admitted and not finished.", [({}, state.in_flight)])
    lines += _line("requests_running", "gauge", "Sequences the engine is running.", [({}, running)])
    lines += _line("requests_waiting", "gauge", "Sequences waiting in the engine's queue.", [({}, waiting)])
    lines += _line("queue_length", "gauge", "Sequences admitted that are not running yet.",
                   [({}, max(0, state.in_flight - running))])
    lines += _line("queue_capacity", "gauge", "Sequences that may wait beyond those running.",
                   [({}, state.config.max_queue)])
    lines += _line("requests_rejected_total", "counter", "Requests refused with 503 (queue full).",
                   [({}, state.rejected)])
    lines += _line("requests_timed_out_total", "counter", "Requests aborted at their timeout.",
                   [({}, state.timed_out)])
    lines += _line("requests_disconnected_total", "counter", "Requests aborted because the client left.",
                   [({}, state.disconnected)])
    lines += _line("kv_blocks_used", "gauge", "KV cache blocks in use.", [({}, int(stats.get("kv_blocks_used", 0)))])
    lines += _line("kv_slots_reserved_unused", "gauge",
                   "KV slots the running sequences hold past their computed positions.",
                   [({}, int(stats.get("kv_slots_reserved_unused", 0)))])
    lines += _line("kv_blocks_total", "gauge", "KV cache blocks in all.", [({}, int(stats.get("kv_blocks_total", 0)))])
    lines += _line("kv_block_size", "gauge", "Tokens a KV cache block holds.", [({}, int(stats.get("block_size", 0)))])
    lines += _line("generated_tokens_total", "counter", "Tokens generated since start.",
                   [({}, int(stats.get("generated_tokens", 0)))])
    lines += _line("generation_tokens_per_second", "gauge", "Tokens generated per second, last 10 s.",
                   [({}, float(state.engine_loop.tokens_per_second()))])
    lines += _line("engine_steps_total", "counter", "Engine steps since start.", [({}, int(stats.get("steps", 0)))])
    lines += _spec_lines(stats)
    return "\n".join(lines) + "\n"


def _spec_lines(stats: dict) -> list[str]:
    """The engine's numeric speculative-decoding figures (none without speculation; a
    ratio is left out until it has a denominator)."""
    lines: list[str] = []
    for key, value in stats.items():
        if not key.startswith(("spec_", "draft_")) or isinstance(value, bool) \
                or not isinstance(value, (int, float)):
            continue
        name, kind, help_text = SPEC_METRICS.get(key, (key, "gauge", f"Speculative decoding: {key}."))
        lines += _line(name, kind, help_text, [({}, value)])
    return lines
