"""`compress bench serve` end to end against real local servers: a server started as a
peer subprocess, and one already running given by --url."""
import json
import sys
from pathlib import Path

import pytest
from openai_stub_server import StubServer

from compress.bench.serve import command
from compress.bench.serve.client import http_json
from compress.bench.serve.peers import PeerError, RunningPeer, free_port

STUB = Path(__file__).with_name("openai_stub_server.py")
RUNNING_LEN, LONG_PROMPT_LEN = 40, 300


def _last_token_until_sampled(server, request, i):
    """hold: a request's last token waits for a /metrics read made while it is in flight,
    so that each load has samples with requests running however late the sampler's
    thread runs. Requests that came before any read (the warm-up, sent before the loads
    and their sampler) are not held."""
    return i == request["max_tokens"] - 1 and 0 < request["metrics_reads"] == server.metrics_reads


def _running_last_token_until_the_long_prompt(server, request, i):
    """hold: a running request's last token waits until the long prompt has come, so that
    some of their gaps overlap its prefill however late it is sent."""
    return (request["max_tokens"] == RUNNING_LEN and i == RUNNING_LEN - 1
            and not any(len(r["prompt"]) == LONG_PROMPT_LEN for r in server.received))


def _args(tmp_path, repo_root, *extra):
    import argparse

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p.parse_args(["--model", str(repo_root / "models" / "pydoc-llama"), "--peers", "",
                         "--num-prompts", "6", "--output-len", "3", "5", "--out", str(tmp_path / "r.json"),
                         *extra])


def test_bench_serve_against_running_servers(tmp_path, repo_root, capsys):
    with StubServer(token_delay=0.02, first_delay=0.005, kv_metrics=True, hold=_last_token_until_sampled) as a, \
            StubServer(token_delay=0.002, first_delay=0.005) as b:
        args = _args(tmp_path, repo_root, "--url", f"a={a.url}", "--url", f"b={b.url}", "--concurrency", "1", "3",
                     "--rounds", "2")
        assert command.main(args) == 0
        sent_a, sent_b = a.received, b.received
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    rows = result["rows"]
    assert [(r["peer"], r["load"]) for r in rows] == [("a", "c=1"), ("b", "c=1"), ("a", "c=3"), ("b", "c=3")]
    assert all(r["completed"] == 12 and r["failed"] == 0 and r["output_len_mismatches"] == 0 for r in rows)
    assert all(len(r["rounds"]) == 2 for r in rows)
    # the warm-up, then 2 loads x 2 rounds x 6 requests; both peers got the same prompts in
    # each (load, round), and every (load, round) its own prompts
    assert len(sent_a) == len(sent_b) == 1 + 24
    runs_a = [sorted(x["prompt"] for x in sent_a[1 + 6 * i:7 + 6 * i]) for i in range(4)]
    runs_b = [sorted(x["prompt"] for x in sent_b[1 + 6 * i:7 + 6 * i]) for i in range(4)]
    assert runs_a == runs_b
    assert len({json.dumps(r) for r in runs_a}) == 4
    assert all(x["ignore_eos"] is True and x["model"] == "stub-model" for x in sent_a)
    # interleaved: in round 2 of each load, b went first
    assert sent_b[7]["at"] < sent_a[7]["at"] and sent_a[1]["at"] < sent_b[1]["at"]
    assert result["settings"]["num_prompts"] == 6 and len(result["settings"]["workload_seeds"]) == 4
    assert "| b | random | c=3 | 12/0 |" in out
    # the KV reserve sampled from a's /metrics while its loads ran (b has none): 3 slots a
    # running sequence, in blocks of 16
    kv = {r["load"]: r["kv_reserve"] for r in rows if r["peer"] == "a"}
    assert all(k["samples"] > 0 and k["reserved_unused_per_seq_mean"] == k["reserved_unused_per_seq_max"] == 3.0
               and k["block_size"] == 16 for k in kv.values())
    assert all(r["kv_reserve"] is None for r in rows if r["peer"] == "b")
    assert "KV reserved beyond use, a c=3: mean 3.0 slots a running sequence (0.19 blocks of 16)" in out

    merged = tmp_path / "m.json"
    args = _args(tmp_path, repo_root, "--merge", str(tmp_path / "r.json"), str(tmp_path / "r.json"))
    args.out = str(merged)
    assert command.main(args) == 0
    assert len(json.loads(merged.read_text())["rows"]) == 8


def test_long_prompt_workload_reports_the_stall(tmp_path, repo_root, capsys):
    with StubServer(token_delay=0.003, first_delay=0.005, hold=_running_last_token_until_the_long_prompt) as server:
        args = _args(tmp_path, repo_root, "--url", f"stub={server.url}", "--workload", "long-prompt",
                     "--running", "2", "--running-output-len", str(RUNNING_LEN),
                     "--long-prompt-len", str(LONG_PROMPT_LEN), "--long-after", "0.02")
        assert command.main(args) == 0
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["load"] == "long-prompt" and row["completed"] == 3 and row["long_prompt"]["runs"] == 1
    assert row["long_prompt"]["long_prompt_tokens"] == LONG_PROMPT_LEN and row["long_prompt"]["gaps_during"] > 0
    assert "ITL p99 during ms" in capsys.readouterr().out


@pytest.mark.parametrize("port_in_log", [True, False], ids=["port-0-read-from-its-output", "port-given"])
def test_peer_subprocess_starts_serves_and_stops(tmp_path, port_in_log):
    port = 0 if port_in_log else free_port()
    peer = RunningPeer("stub", [sys.executable, str(STUB), str(port)], tmp_path / "stub.log",
                       None if port_in_log else f"http://127.0.0.1:{port}")
    with peer:
        process = peer.process
        assert process.poll() is None
        assert peer.base_url.startswith("http://127.0.0.1:") and not peer.base_url.endswith(":0")
        assert http_json(peer.base_url + "/health")[0] == 200
    assert process.poll() is not None, "stopped when the block ends"
    assert (tmp_path / "stub.log").read_text().startswith("$ ")


@pytest.mark.parametrize("port_in_log", [True, False], ids=["port-0", "port-given"])
def test_peer_that_dies_is_reported_with_its_log(tmp_path, port_in_log):
    peer = RunningPeer("broken", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                       tmp_path / "broken.log", None if port_in_log else f"http://127.0.0.1:{free_port()}")
    with pytest.raises(PeerError, match="(?s)exited with 3.*no model here"):
        peer.start(ready_timeout=20)


def test_peer_that_never_names_its_port_is_reported(tmp_path):
    peer = RunningPeer("mute", [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"],
                       tmp_path / "mute.log", None)
    with pytest.raises(PeerError, match="(?s)mute: no 'compress serve: ... on URL' line after 1 s.*loading"):
        peer.start(ready_timeout=1)
    assert peer.process is None, "stopped"


def test_unknown_peer_is_named(tmp_path, repo_root):
    args = _args(tmp_path, repo_root)
    args.peers = "ours,vllm"
    with pytest.raises(Exception, match="unknown peer 'vllm'"):
        command.run_bench(args)


def test_peer_table(tmp_path):
    from compress.bench.serve.peers import PeerSettings

    s = PeerSettings(model="/m/rtn-int4", threads=2)
    ours = RunningPeer.from_settings("ours", s, tmp_path)
    serial = RunningPeer.from_settings("ours-serial", s, tmp_path)
    assert ours.command[ours.command.index("serve") + 1] == "/m/rtn-int4"
    assert ours.command[ours.command.index("--threads") + 1] == "2" and "--max-num-seqs" not in ours.command
    assert serial.command[serial.command.index("--max-num-seqs") + 1] == "1"
    assert ours.body == serial.body == {"logprobs": 0}, "ours streams one chunk per token only with logprobs"
    assert ours.command[ours.command.index("--port") + 1] == "0", "ours picks its port and names it"
    assert ours.base_url is None and serial.base_url is None and ours.log_path == tmp_path / "ours.log"
    with pytest.raises(PeerError, match="no GGUF"):
        RunningPeer.from_settings("llamacpp", s, tmp_path)


def test_server_tokenizes_when_the_model_has_no_tokenizer():
    with StubServer() as server:
        assert command.server_encoder(server.url)("ab c defg") == [2, 1, 4]
    with pytest.raises(Exception, match="did not tokenize"):
        command.server_encoder("http://127.0.0.1:9")("x")
