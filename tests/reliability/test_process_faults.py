"""Process faults on a live server: engine SIGKILL and SIGSTOP, API SIGKILL, and a SIGTERM
drain that outlasts --shutdown-timeout. Each ends with no process and no IPC file left."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from reliability_harness import MODEL_NAME, greedy_text, pid_alive, run_isolated, wait_until

LONG = {"model": MODEL_NAME, "prompt": "Tell me everything.", "max_tokens": 480,
        "ignore_eos": True}  # fmt: skip


def stream_events(url: str, body: dict, results: dict, started: threading.Event) -> None:
    """POST a streaming request; record the status and every SSE payload."""
    events: list[str] = []
    try:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
            results["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        results["error"] = repr(e)
    results["events"] = events
    started.set()


def test_engine_sigkill(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with run_isolated(tiny_model, tmp_path, monkeypatch, "--engine-dead-exit-delay", "1") as (
        server,
        tmpdir,
    ):
        engine_pid = server.engine_pid()
        assert list(tmpdir.glob("rackserve-*/*")), "the IPC sockets should be here"
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        code = server.process.wait(10)
        exit_s = time.monotonic() - killed_at
        assert code != 0 and exit_s < 10
        assert not pid_alive(engine_pid)
        assert not list(tmpdir.iterdir()), "the IPC directory outlived the server"


def test_engine_sigstop_sigcont(tiny_model: Path, tmp_path: Path, monkeypatch):
    with run_isolated(tiny_model, tmp_path, monkeypatch) as (server, _):
        reference = greedy_text(server)
        engine_pid = server.engine_pid()
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            # A frozen engine answers no ping: /health must not say 200.
            with pytest.raises(httpx.TimeoutException):
                httpx.get(f"{server.base_url}/health", timeout=2)
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        recovered_s = wait_until(
            lambda: httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200,
            10,
            "health after SIGCONT",
        )
        assert recovered_s < 5
        assert greedy_text(server) == reference
        assert server.process.poll() is None


def test_api_sigkill_takes_the_engine_and_ipc_dir(tiny_model: Path, tmp_path: Path, monkeypatch):
    with run_isolated(tiny_model, tmp_path, monkeypatch) as (server, tmpdir):
        engine_pid = server.engine_pid()
        server.process.kill()
        server.process.wait(10)
        wait_until(lambda: not pid_alive(engine_pid), 10, "the orphaned engine to exit")
        wait_until(lambda: not list(tmpdir.iterdir()), 5, "the IPC directory to go")


def test_drain_past_shutdown_timeout_ends_requests_cleanly(
    tiny_model: Path, tmp_path: Path, monkeypatch
):
    with run_isolated(tiny_model, tmp_path, monkeypatch, "--shutdown-timeout", "1") as (
        server,
        tmpdir,
    ):
        url = f"{server.base_url}/v1/completions"
        streamed: dict = {}
        started = threading.Event()
        streamer = threading.Thread(target=stream_events, args=(url, LONG, streamed, started))
        streamer.start()
        assert started.wait(60)
        blocking: dict = {}

        def non_streaming() -> None:
            blocking["response"] = httpx.post(url, json=LONG, timeout=120)

        waiter = threading.Thread(target=non_streaming)
        waiter.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        streamer.join(60)
        waiter.join(60)
        events = streamed["events"]
        assert events[-1] == "[DONE]", streamed
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "shut down" in error["message"]
        response = blocking["response"]
        assert response.status_code == 503, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert server.process.wait(30) == 0
        assert not list(tmpdir.iterdir())
