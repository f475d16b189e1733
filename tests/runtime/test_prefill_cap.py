"""The prompt-token cap sized from step times (runtime/prefill_cap.py) and the engine
option that uses it (LLM(max_itl_ratio=...), compress serve --max-itl-ratio)."""
import pytest

from compress.runtime import LLM, SamplingParams
from compress.runtime.prefill_cap import PrefillCap


def test_cap_settles_where_a_mixed_step_takes_ratio_decode_steps():
    """Decode steps of 20 ms, prompt tokens at 2 ms each: 1.5x a decode step leaves room
    for 5 tokens; the cap moves halfway down to it each mixed step."""
    cap = PrefillCap(1.5, limit=512, start=16)
    assert cap.observe(0.020, decode_rows=6, prompt_tokens=0) == 16   # baseline only
    caps = [cap.observe(0.020 + 0.002 * cap.cap, decode_rows=6, prompt_tokens=cap.cap) for _ in range(8)]
    assert caps[:4] == [10, 7, 6, 5] and caps[-1] == 5
    # the context grows: tokens cost 10 ms each now, one token already takes 1.5x
    for _ in range(20):
        cap.observe(0.020 + 0.010 * cap.cap, decode_rows=6, prompt_tokens=cap.cap)
    assert cap.cap == 1
    # cheap tokens again: it climbs back by half at the most a step, never past the limit
    climb = [1] + [cap.observe(0.020 + 0.00001 * cap.cap, decode_rows=6, prompt_tokens=cap.cap) for _ in range(60)]
    assert all(a <= b <= max(a + 1, int(1.5 * a)) for a, b in zip(climb, climb[1:]))
    assert climb[-1] == 512


def test_the_cap_starts_at_one_token_and_climbs_while_steps_allow():
    """Before a mixed step has priced a prompt token, the cap is one token (a larger first
    chunk may be the step that stalls every running request); cheap tokens raise it by
    half a step."""
    cap = PrefillCap(1.5, limit=64)
    assert cap.cap == 1
    cap.observe(0.020, decode_rows=6, prompt_tokens=0)
    climb = [cap.observe(0.020 + 1e-5 * cap.cap, decode_rows=6, prompt_tokens=cap.cap) for _ in range(9)]
    assert climb == [2, 3, 4, 6, 9, 13, 19, 28, 42]


def test_one_fast_step_does_not_make_the_next_one_long():
    """A mixed step that ran faster than the decode baseline (noise) leaves the cap at most
    half again as large."""
    cap = PrefillCap(1.5, limit=512, start=8)
    cap.observe(0.020, decode_rows=6, prompt_tokens=0)
    cap.observe(0.030, decode_rows=6, prompt_tokens=8)   # 1.25 ms a token: goal 8
    assert cap.cap == 8
    assert 8 <= cap.observe(0.015, decode_rows=6, prompt_tokens=8) <= 12


def test_cap_ignores_steps_without_decodes_and_waits_for_a_baseline():
    cap = PrefillCap(2.0, limit=64, start=8)
    assert cap.observe(0.5, decode_rows=0, prompt_tokens=64) == 8    # a prefill-only step delays nobody
    assert cap.observe(0.05, decode_rows=3, prompt_tokens=8) == 8    # mixed, but no decode baseline yet
    cap.observe(0.02, decode_rows=3, prompt_tokens=0)
    assert cap.decode_seconds == pytest.approx(0.02)
    cap.observe(0.03, decode_rows=3, prompt_tokens=0)
    assert cap.decode_seconds == pytest.approx(0.022)               # exponential average, weight 0.2


def test_a_stale_baseline_asks_for_a_decode_only_step():
    """No baseline yet, or ``refresh`` mixed steps since the last decode-only step: the
    engine is asked for a step without prompt tokens."""
    cap = PrefillCap(1.5, limit=64, start=8, refresh=3)
    assert cap.wants_decode_only()                                   # no baseline at all
    cap.observe(0.02, decode_rows=4, prompt_tokens=0)
    assert not cap.wants_decode_only()
    for _ in range(2):
        cap.observe(0.03, decode_rows=4, prompt_tokens=cap.cap)
        assert not cap.wants_decode_only()
    cap.observe(0.03, decode_rows=4, prompt_tokens=cap.cap)
    assert cap.wants_decode_only()
    cap.observe(0.5, decode_rows=0, prompt_tokens=64)                # prefill-only: not a baseline
    assert cap.wants_decode_only()
    cap.observe(0.021, decode_rows=4, prompt_tokens=0)
    assert not cap.wants_decode_only()


@pytest.mark.parametrize("refresh", [8, 10**9], ids=["refreshed", "never-refreshed"])
def test_the_cap_holds_while_decode_steps_slow_down(refresh):
    """Decode steps slow by 0.5% a step (their contexts grow) while prompt tokens cost 1 ms
    each: with the baseline refreshed (a decode-only step when the engine is asked), the
    cap stays near the goal, (ratio - 1) x the decode step's time over a token's; measured
    once, the baseline goes stale, the growth is put on the prompt tokens and the cap
    falls to one token (what a long prompt among running requests hit)."""
    cap = PrefillCap(1.5, limit=512, start=16, refresh=refresh)
    decode = 0.010
    cap.observe(decode, decode_rows=6, prompt_tokens=0)
    for _ in range(300):
        decode *= 1.005
        if cap.wants_decode_only():
            cap.observe(decode, decode_rows=6, prompt_tokens=0)
        else:
            cap.observe(decode + 0.001 * cap.cap, decode_rows=6, prompt_tokens=cap.cap)
    goal = int(0.5 * decode / 0.001)          # 22 tokens at the end
    if refresh == 8:
        assert goal * 0.7 <= cap.cap <= goal
    else:
        assert cap.cap == 1


@pytest.mark.parametrize("ratio", [1.0, 0.5, float("nan"), float("inf")])
def test_bad_ratios_are_refused(ratio):
    with pytest.raises(ValueError, match="max_itl_ratio"):
        PrefillCap(ratio, limit=16)


def test_engine_sizes_the_cap_and_keeps_every_request_s_tokens(llama_dir):
    """Requests decoding while a long prompt arrives: the cap moves off its start, and the
    greedy tokens are those of a run without any cap."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[3, 4, 5], [6, 7], list(range(10, 200))]
    plain = LLM(llama_dir, max_batch_size=4, enable_prefix_caching=False)
    capped = LLM(llama_dir, max_batch_size=4, enable_prefix_caching=False, max_itl_ratio=1.5)
    eng = capped.engine
    for i, p in enumerate(prompts[:2]):
        eng.add_request(f"r{i}", p, params)
    for _ in range(4):
        eng.step()
    eng.add_request("long", prompts[2], params)
    eng.prefill_cap.refresh = 2
    outs = {}
    decode_only_steps_while_long_prefilled = 0
    while eng.has_unfinished():
        long = eng.requests.get("long")
        prefilled_before = None if long is None else long.num_computed_tokens
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        if (long is not None and 0 < long.num_computed_tokens == prefilled_before < len(prompts[2])
                and any(r in eng.requests for r in ("r0", "r1"))):
            decode_only_steps_while_long_prefilled += 1
    assert eng.prefill_cap.decode_seconds is not None
    assert decode_only_steps_while_long_prefilled >= 1
    assert eng.scheduler.max_prefill_tokens_with_decodes == eng.prefill_cap.cap
    want = plain.generate(prompts, params)
    assert [outs["r0"], outs["r1"], outs["long"]] == [o.token_ids for o in want]


def test_engine_refuses_both_caps(llama_dir):
    with pytest.raises(ValueError, match="not both"):
        LLM(llama_dir, max_itl_ratio=1.5, max_prefill_tokens_with_decodes=8)
    with pytest.raises(ValueError, match="chunked prefill"):
        LLM(llama_dir, max_itl_ratio=1.5, enable_chunked_prefill=False)
