"""The scheduler without a model: token budget, decodes before prefill chunks, whole
prompts without chunking, the running cap, preemption by recompute, FCFS."""
from __future__ import annotations

from compress.runtime.block_manager import BlockManager
from compress.runtime.sampling import SamplingParams
from compress.runtime.scheduler import Scheduler
from compress.runtime.sequence import Sequence, SequenceStatus


def seq(n: int, rid: str, max_tokens: int = 100) -> Sequence:
    return Sequence(rid, None, list(range(2, n + 2)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), set())


def run_step(sched: Scheduler, decode_only: bool = False) -> list[tuple[str, int]]:
    """Schedules a step, then does what the engine does: tokens computed, a token
    appended to each sequence that finished its known tokens."""
    batch = sched.schedule(decode_only=decode_only)
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append(7)
            if s.finished:
                sched.finish(s)
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_decodes_first_then_a_prefill_chunk_within_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    for i in range(3):
        sched.add(seq(2, f"d{i}"))
    assert run_step(sched) == [("d0", 2), ("d1", 2), ("d2", 2)]   # 6 of 8; the next would need 2
    sched.add(seq(20, "long"))
    assert run_step(sched) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 5)]
    assert run_step(sched) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 5)]  # the chunk goes on, decodes too
    steps = [run_step(sched) for _ in range(2)]
    assert steps[-1][-1] == ("long", 5) and sched.running[-1].num_computed_tokens == 20
    assert run_step(sched)[-1] == ("long", 1)   # prefilled: now a decode


def test_prefill_cap_while_decoding():
    """max_prefill_tokens_with_decodes: with decodes in the step, prompt chunks (a running
    one and newly admitted ones together) take at most that many tokens; with no decodes
    a prompt takes the whole budget."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16, max_prefill_tokens_with_decodes=3)
    sched.add(seq(20, "long"))
    assert run_step(sched) == [("long", 16)]          # nothing decodes yet: the whole budget
    sched.add(seq(2, "d"))
    assert run_step(sched) == [("long", 4), ("d", 2)]  # still no decode in the step: no cap
    sched.add(seq(10, "next"))
    sched.add(seq(10, "later"))
    assert run_step(sched) == [("long", 1), ("d", 1), ("next", 3)]   # decodes: prompts get 3 in all
    assert run_step(sched) == [("long", 1), ("d", 1), ("next", 3)]
    assert run_step(sched) == [("long", 1), ("d", 1), ("next", 3)]
    # next's last prompt token is a one-token step, as a decode is: later gets the 3
    assert run_step(sched) == [("long", 1), ("d", 1), ("next", 1), ("later", 3)]
    assert run_step(sched) == [("long", 1), ("d", 1), ("next", 1), ("later", 3)]


def test_a_decode_only_step_takes_no_prompt_tokens_while_something_decodes():
    """schedule(decode_only=True), the step PrefillCap measures its baseline on: running
    prompts and waiting ones wait while a sequence decodes; with nothing decoding the
    prompts take the budget as usual (nobody's gap to protect)."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16, max_prefill_tokens_with_decodes=3)
    sched.add(seq(20, "long"))
    assert run_step(sched, decode_only=True) == [("long", 16)]      # nothing decodes
    sched.add(seq(2, "d"))
    assert run_step(sched) == [("long", 4), ("d", 2)]
    sched.add(seq(10, "next"))
    assert run_step(sched, decode_only=True) == [("long", 1), ("d", 1)]   # next waits, uncounted
    assert [s.request_id for s in sched.waiting] == ["next"]
    assert run_step(sched) == [("long", 1), ("d", 1), ("next", 3)]
    # without a cap too: decode_only alone holds the prompts back
    free = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    free.add(seq(2, "d"))
    run_step(free)
    free.add(seq(30, "p"))
    assert run_step(free, decode_only=True) == [("d", 1)]
    assert run_step(free) == [("d", 1), ("p", 15)]
    assert run_step(free, decode_only=True) == [("d", 1)]


def test_without_chunking_a_prompt_runs_whole():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(seq(2, "d"))
    run_step(sched)
    sched.add(seq(20, "long"))
    sched.add(seq(3, "short"))
    # the first prompt of a step may exceed what is left of the budget; nothing after it
    assert run_step(sched) == [("d", 1), ("long", 20)]
    assert run_step(sched) == [("d", 1), ("long", 1), ("short", 3)]


def test_running_cap_and_fcfs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(seq(3, f"r{i}", max_tokens=2))
    assert [rid for rid, _ in run_step(sched)] == ["r0", "r1"]
    assert [rid for rid, _ in run_step(sched)] == ["r0", "r1"]   # both finish here (2 tokens)
    assert [rid for rid, _ in run_step(sched)] == ["r2", "r3"]


def test_preemption_by_recompute_of_the_newest():
    bm = BlockManager(5, 2)   # 10 positions
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq(4, "a"), seq(4, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)                   # a: blocks 0-1 (5 tokens after it), b: blocks 2-3
    assert bm.num_free_blocks == 1
    run_step(sched)                   # a takes the last block for position 4; b's position 4 needs one: none
    assert [s.request_id for s in sched.running] == ["a"] and list(sched.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and list(b.block_table) == []
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert b.output_ids == [7]        # what it generated is kept and recomputed with the prompt
    sched.add(seq(1, "late"))         # arrives after b: b goes first when there is room
    a.finish("stop")
    sched.finish(a)
    assert run_step(sched) == [("b", 5), ("late", 1)]


def test_a_sequence_longer_than_the_pool_finishes():
    sched = Scheduler(BlockManager(2, 2), max_num_seqs=4, max_num_batched_tokens=100)
    s = seq(3, "s")
    sched.add(s)
    run_step(sched)
    run_step(sched)                   # 4 tokens fill the pool; the 5th position has no room anywhere
    batch = sched.schedule()
    assert batch.finished == [s] and s.finish_reason == "length" and not sched.has_unfinished()
    assert sched.block_manager.num_used_blocks == 0
