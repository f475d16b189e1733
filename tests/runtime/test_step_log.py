"""The engine's per-step records (runtime/step_log.py) and their file
(compress serve --step-log, serve/cli.py: write_step_log)."""
from compress.runtime import LLM, SamplingParams
from compress.runtime.step_log import HEADER, StepLog
from compress.serve.cli import write_step_log


def test_the_log_accounts_for_every_token_the_engine_ran(llama_dir):
    """Requests decoding while a long prompt is chunked beside them: the log's decode rows
    and prompt tokens add up to the engine's counters, split into decode-only, mixed and
    prefill-only steps as the scheduler ran them."""
    llm = LLM(llama_dir, max_batch_size=4, enable_prefix_caching=False, max_prefill_tokens_with_decodes=8)
    eng = llm.engine
    eng.step_log = StepLog()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, p in enumerate([[3, 4, 5], [6, 7]]):
        eng.add_request(f"r{i}", p, params)
    for _ in range(3):
        eng.step()
    eng.add_request("long", list(range(10, 90)), params)
    while eng.has_unfinished():
        eng.step()
    s = eng.step_log.summary()
    assert sum(s[k]["decode_rows"] for k in ("decode-only", "mixed", "prefill-only")) == eng.tokens_decoded
    assert sum(s[k]["prompt_tokens"] for k in ("decode-only", "mixed", "prefill-only")) == eng.tokens_prefilled
    assert s["mixed"]["steps"] >= 80 // 8 - 1          # the long prompt went in chunks of 8 beside decodes
    assert s["mixed"]["prompt_tokens"] <= 8 * s["mixed"]["steps"]
    assert s["prefill-only"]["steps"] >= 1 and s["decode-only"]["steps"] >= 1
    assert sum(s[k]["steps"] for k in ("decode-only", "mixed", "prefill-only")) == eng.steps
    assert 0 < sum(s[k]["seconds"] for k in ("decode-only", "mixed", "prefill-only")) <= s["wall_seconds"]


def test_the_file_is_written_whole_with_a_summary(tmp_path, capsys):
    log = StepLog(max_steps=3)
    for i in range(5):
        log.add(100.0 + i, 0.01, 2 if i % 2 else 0, 0 if i == 3 else 16)
    path = tmp_path / "steps.tsv"
    write_step_log(log, path)
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER and len(lines) == 4                      # the newest 3 steps kept
    assert [line.split("\t")[2:] for line in lines[1:]] == [["0", "16"], ["2", "0"], ["0", "16"]]
    out = capsys.readouterr().out
    assert "3 steps over 2.01 s" in out and "decode-only: 1 steps" in out and "prefill-only: 2 steps" in out
    assert list(tmp_path.iterdir()) == [path]                           # no temporary left
