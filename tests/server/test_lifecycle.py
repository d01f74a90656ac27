"""Process lifecycle: engine death and SIGTERM drain, each on its own server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import MODEL_NAME, Server, pid_alive, run_server

BODY = {
    "model": MODEL_NAME, "prompt": "Tell me everything.", "max_tokens": 300, "ignore_eos": True,
}  # fmt: skip


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def first_chunk_then_rest(server: Server, results: dict, started: threading.Event) -> None:
    """Stream BODY; record every SSE payload (started is set at the first one)."""
    events = []
    try:
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json={**BODY, "stream": True},
            timeout=120,
        ) as response:  # fmt: skip
            results["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        results["error"] = repr(e)
    results["events"] = events
    started.set()


def test_engine_death(tiny_model: Path, tmp_path: Path) -> None:
    with run_server(tiny_model, tmp_path, "--engine-dead-exit-delay", "3") as server:
        engine_pid = server.engine_pid()
        results: dict = {}
        started = threading.Event()
        streamer = threading.Thread(target=first_chunk_then_rest, args=(server, results, started))
        streamer.start()
        assert started.wait(60)
        non_streaming: dict = {}

        def blocking() -> None:
            url = f"{server.base_url}/v1/completions"
            non_streaming["response"] = httpx.post(url, json=BODY, timeout=120)

        waiter = threading.Thread(target=blocking)
        waiter.start()
        time.sleep(0.5)

        os.kill(engine_pid, signal.SIGKILL)
        streamer.join(30)
        waiter.join(30)
        # in-flight requests: a 500, and an SSE error event in the started stream
        assert non_streaming["response"].status_code == 500
        assert non_streaming["response"].json()["error"]["type"] == "server_error"
        events = results["events"]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503
        # the server exits non-zero after the watchdog delay, leaving no process behind
        assert server.process.wait(30) != 0
        assert not pid_alive(engine_pid)


def test_sigterm_drains_running_requests(tiny_model: Path, tmp_path: Path) -> None:
    with run_server(tiny_model, tmp_path, "--shutdown-timeout", "60") as server:
        engine_pid = server.engine_pid()
        results: dict = {}
        started = threading.Event()
        streamer = threading.Thread(target=first_chunk_then_rest, args=(server, results, started))
        streamer.start()
        assert started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        streamer.join(120)
        events = results["events"]
        assert events[-1] == "[DONE]", results
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finals[-1] == "length"  # the request ran to its end
        assert server.process.wait(30) == 0
        assert not pid_alive(engine_pid)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.base_url}/health", timeout=2)


def test_engine_exits_when_api_process_is_killed(tiny_model: Path, tmp_path: Path) -> None:
    with run_server(tiny_model, tmp_path) as server:
        engine_pid = server.engine_pid()
        server.process.kill()  # no chance to clean up: the engine must notice by itself
        server.process.wait(10)
        wait_for(lambda: not pid_alive(engine_pid), 10, "the orphaned engine to exit")


def test_model_vocabulary_past_the_tokenizer(tiny_model: Path, tmp_path: Path) -> None:
    """A checkpoint whose embedding is padded past its tokenizer (DeepSeek's is: 129,280
    rows): sampled ids with no token decode as nothing. On 2026-12-02 the first such id
    raised in the API process's detokenizer and the whole server answered 503 after it."""
    import shutil

    from rackserve.model.tokenizer import write_tokenizer

    model = tmp_path / "padded"
    shutil.copytree(tiny_model, model)
    write_tokenizer(model, 512)  # the model samples from 4096 ids
    with run_server(model, tmp_path) as server:
        for stream in (False, True, False):
            body = {**BODY, "max_tokens": 24, "temperature": 1.0, "seed": 3, "stream": stream}
            r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        usage = httpx.post(
            f"{server.base_url}/v1/completions", json={**BODY, "max_tokens": 24}, timeout=120
        ).json()["usage"]
        assert usage["completion_tokens"] == 24
