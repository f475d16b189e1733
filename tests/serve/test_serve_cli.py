"""``compress serve`` as a process: it serves, and SIGTERM drains what can finish within
the grace period, aborts the rest and exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import EMBEDDED, MAX_NUM_SEQS, MODEL_NAME


def test_the_listening_line_names_the_bound_url():
    from compress.serve.server import listen_socket, listening_line, socket_url, url_in_log

    with listen_socket("127.0.0.1", 0) as sock:
        url = socket_url(sock)
        port = sock.getsockname()[1]
        assert port > 0 and url == f"http://127.0.0.1:{port}"
        line = listening_line("m", "/x/on http://y (z)", url, " (API key required) (speculative: ngram, k=3)")
        assert url_in_log(f"loading\n{line}\nmore\n") == url
        assert url_in_log(listening_line("m", "p", url)) == url
        assert url_in_log("compress serve: KV cache 12 blocks\n") is None


def test_an_ipv6_address_is_bracketed_in_the_url():
    from compress.errors import UserError
    from compress.serve.server import listen_socket, socket_url

    try:
        sock = listen_socket("::1", 0)
    except UserError:
        pytest.skip("no IPv6 loopback on this machine")
    with sock:
        assert socket_url(sock) == f"http://[::1]:{sock.getsockname()[1]}"


def test_a_port_in_use_is_named_before_the_model_loads(capsys):
    from compress.cli import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", str(EMBEDDED), "--port", str(port)]) == 2
        assert time.monotonic() - t0 < 5, "refused before loading the model"
    out, err = capsys.readouterr()
    assert "KV cache" not in out, "the model was loaded first"
    assert f"compress serve: error: cannot listen on 127.0.0.1:{port} (--host / --port)" in err


def test_serve_parser_defaults_to_the_embedded_model():
    from compress.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.path == str(EMBEDDED) and args.host == "127.0.0.1" and args.func.__name__ == "_cmd_serve"


def test_bad_options_are_one_line_errors(tmp_path):
    from compress.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert main(["serve", "--max-queue", "-1"]) == 2
    assert main(["serve", "--max-prefill-tokens-with-decodes", "0"]) == 2
    for ratio in ("1", "0.5", "nan", "inf"):
        assert main(["serve", "--max-itl-ratio", ratio]) == 2
    assert main(["serve", "--max-itl-ratio", "1.5", "--max-prefill-tokens-with-decodes", "8"]) == 2


def test_bad_draft_is_a_one_line_error(tmp_path, capsys):
    from compress.cli import main

    assert main(["serve", "--draft", str(tmp_path / "missing-draft")]) == 2
    err = capsys.readouterr().err
    assert "--draft" in err and str(tmp_path / "missing-draft") in err and "Traceback" not in err
    assert main(["serve", "--num-speculative-tokens", "2"]) == 2
    assert "--draft" in capsys.readouterr().err


def test_stopping_aborts_what_outlives_the_grace_period(embedded_llm, monkeypatch):
    """In process: a stream still running at the end of the grace period gets the 503
    error event and [DONE], its blocks are freed, and the engine thread ends."""
    from compress.serve.server import ServerThread
    from compress.serve.state import ServeConfig

    srv = ServerThread(embedded_llm, ServeConfig(model_name="m"), shutdown_grace=0.5).start()
    engine = srv.state.engine_loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])
    lines = []
    with requests.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 900, "ignore_eos": True,
                                                          "stream": True}, stream=True, timeout=30) as r:
        it = r.iter_lines()
        lines.append(next(it))
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        lines.extend(line for line in it if line)
    stopper.join(30)
    assert lines[-1] == b"data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
    assert not srv.state.engine_loop.alive and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_serving_with_a_draft_is_lossless_and_counts_in_metrics(draft, references):
    """``compress serve --draft``'s LLM (built from the parsed command line) answers greedy
    completions, whole and streamed, with the text of plain decoding, and /metrics carries
    the speculative counters."""
    from compress.cli import build_parser
    from compress.serve.cli import build_llm
    from compress.serve.server import ServerThread
    from compress.serve.soak import parse_metrics
    from compress.serve.state import ServeConfig

    args = build_parser().parse_args(["serve", str(EMBEDDED), "--draft", str(EMBEDDED) if draft == "model" else draft,
                                      "--num-speculative-tokens", "3", "--max-num-seqs", str(MAX_NUM_SEQS)])
    llm = build_llm(args)
    assert llm.speculative.num_speculative_tokens == 3 and (llm.draft_model is not None) == (draft == "model")
    with ServerThread(llm, ServeConfig(model_name=MODEL_NAME, max_num_seqs=MAX_NUM_SEQS, request_timeout=60)) as srv:
        r = requests.post(srv.url + "/v1/completions", json={"prompt": references["prompts"], "max_tokens": 12,
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == references["texts"]
        deltas = []
        with requests.post(srv.url + "/v1/completions", json={"prompt": references["prompts"][0], "max_tokens": 12,
                                                              "temperature": 0, "stream": True},
                           stream=True, timeout=60) as s:
            for line in s.iter_lines():
                if line and line != b"data: [DONE]":
                    deltas += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(deltas) == references["texts"][0]
        text = requests.get(srv.url + "/metrics").text
    metrics = parse_metrics(text)
    assert "# TYPE compress_spec_steps_total counter" in text
    assert metrics["compress_spec_num_speculative_tokens"] == 3
    assert metrics["compress_spec_steps_total"] > 0 and metrics["compress_spec_rows_total"] > 0
    assert metrics["compress_spec_emitted_tokens_total"] >= metrics["compress_spec_rows_total"]
    if draft == "model":        # the target drafting for itself
        assert metrics["compress_spec_draft_tokens_total"] > 0 and metrics["compress_spec_accepted_tokens_total"] > 0
        assert metrics["compress_spec_acceptance_rate"] > 0.5 and metrics["compress_draft_forwards_total"] > 0
        assert metrics["compress_spec_mean_tokens_per_row_step"] > 1
    else:
        assert "compress_draft_forwards_total" not in metrics


def test_metrics_have_no_spec_counters_without_speculation():
    from compress.serve.metrics import _spec_lines

    assert _spec_lines({"steps": 3, "kv_blocks_used": 1, "native_decode": True}) == []
    lines = _spec_lines({"spec_method": "ngram", "spec_k": 2, "spec_steps": 5, "spec_acceptance_rate": 0.25,
                         "spec_mean_tokens_per_row_step": None, "spec_accepted_hist": [1, 2, 0]})
    assert [ln for ln in lines if not ln.startswith("#")] == [
        "compress_spec_num_speculative_tokens 2", "compress_spec_steps_total 5", "compress_spec_acceptance_rate 0.25"]


def test_runtime_options_are_checked_against_the_llm():
    from argparse import Namespace

    from compress.errors import UserError
    from compress.serve.cli import llm_kwargs

    class OldLLM:
        def __init__(self, path, threads=None, max_batch_size=32):
            pass

    assert llm_kwargs(Namespace(threads=2, max_num_seqs=8, block_size=None), OldLLM) == {
        "threads": 2, "max_batch_size": 8}
    with pytest.raises(UserError, match="--block-size"):
        llm_kwargs(Namespace(block_size=4), OldLLM)
    with pytest.raises(UserError, match="--draft"):
        llm_kwargs(Namespace(draft="ngram", num_speculative_tokens=None), OldLLM)


@pytest.mark.slow
def test_sigterm_drains_then_aborts_and_exits_zero(tmp_path):
    from compress.serve.server import url_in_log

    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "compress.cli", "serve", str(EMBEDDED), "--port", "0",
                             "--shutdown-grace", "8", "--max-num-seqs", "8", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=EMBEDDED.parents[1])
    url = None
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            url = url or url_in_log((tmp_path / "serve.log").read_text())   # port 0: the one it got
            try:
                if url and requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        events: dict[str, list[bytes]] = {"short": [], "long": []}
        first = {name: threading.Event() for name in events}

        def stream(name, body):
            try:
                with requests.post(url + "/v1/completions", json={**body, "stream": True}, stream=True,
                                   timeout=60) as r:
                    for line in r.iter_lines():
                        if line:
                            events[name].append(line)
                            first[name].set()
            except requests.RequestException:
                pass
            first[name].set()

        # short: 30 engine steps, in flight when SIGTERM comes, done well within the grace period;
        # long: 40 sequences of 1000 tokens, 8 at a time -- 5000 engine steps, far beyond it
        long_body = {"prompt": ["Return the"] * 40, "max_tokens": 1000, "ignore_eos": True}
        threads = [threading.Thread(target=stream, args=("short", {"prompt": "Return the", "max_tokens": 30,
                                                                   "ignore_eos": True})),
                   threading.Thread(target=stream, args=("long", long_body))]
        threads[0].start()
        assert first["short"].wait(60)
        threads[1].start()
        assert first["long"].wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(10)
        short = [json.loads(e[6:]) for e in events["short"][:-1]]
        assert events["short"][-1] == b"data: [DONE]" and short[-1]["choices"][0]["finish_reason"] == "length"
        long = [json.loads(e[6:]) for e in events["long"][:-1]]          # aborted at the end of the grace
        assert events["long"][-1] == b"data: [DONE]"
        assert long[-1]["error"]["code"] == "server_shutting_down"
        assert sum(1 for d in long for c in d.get("choices", []) if c["finish_reason"]) < 40
        assert elapsed < 30
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_loaded_objects_are_frozen_out_of_full_collections():
    """compress serve freezes what loading left alive (the model, its tensors, the
    tokenizer), so a later full collection does not walk it; a new object stays collectable."""
    import gc

    from compress.serve.cli import freeze_loaded_objects
    loaded = [[i] for i in range(1000)]           # lists: tracked by the collector
    try:
        frozen = freeze_loaded_objects()
        collected = {id(o) for o in gc.get_objects()}  # the generations a collection walks
        assert frozen >= 1000 and not any(id(x) in collected for x in loaded)
        import weakref

        class Node:
            pass
        node = Node()
        node.me = node                 # a cycle made after the freeze, then dropped
        alive = weakref.ref(node)
        del node
        gc.collect()
        # still frozen after a full collection (other threads of a test run may free some)
        assert alive() is None and gc.get_freeze_count() >= frozen - 1000
        assert not any(id(x) in {id(o) for o in gc.get_objects()} for x in loaded[:10])
    finally:
        gc.unfreeze()
        del loaded
