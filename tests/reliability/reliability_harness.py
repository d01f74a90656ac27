"""Helpers of the standing reliability suite: real `rackserve serve` processes on loopback.

A module of its own name (not conftest.py, which tests/server also has: one run that
collects both folders would see only one of them under the name ``conftest``).

Reuses the server harness of tests/server (loaded under its own module name, since both
folders have a conftest.py) and adds what these tests measure: process memory, the
engine's queue and KV gauges from /metrics, and the processes and IPC files a server
leaves behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

_spec = importlib.util.spec_from_file_location(
    "server_harness", Path(__file__).parents[1] / "server" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
sys.modules["server_harness"] = harness  # dataclasses look their module up there
_spec.loader.exec_module(harness)

MODEL_NAME = harness.MODEL_NAME
Server = harness.Server
child_pids, pid_alive, run_server = harness.child_pids, harness.pid_alive, harness.run_server
tiny_model = harness.tiny_model  # the session fixture; conftest.py re-exports it
JSON = {"Content-Type": "application/json"}
GREEDY = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8,
          "temperature": 0, "ignore_eos": True}  # fmt: skip
_SAMPLE = re.compile(r"^(rackserve:\w+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def metrics(server: Server) -> dict[str, float]:
    """/metrics samples as ``name{labels}`` -> value (model_name label dropped)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    out = {}
    for name, labels, value in _SAMPLE.findall(text):
        kept = ",".join(p for p in labels.split(",") if p and not p.startswith("model_name="))
        out[f"{name}{{{kept}}}" if kept else name] = float(value)
    return out


def engine_idle(server: Server) -> bool:
    m = metrics(server)
    return (
        m.get("rackserve:num_requests_running") == 0
        and m.get("rackserve:num_requests_waiting") == 0
        and m.get("rackserve:kv_cache_usage_perc") == 0
    )


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


def greedy_text(server: Server) -> str:
    response = httpx.post(f"{server.base_url}/v1/completions", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@contextlib.contextmanager
def run_isolated(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> Iterator[tuple[Server, Path]]:
    """A server whose temporary files (the IPC directory) go to a folder of its own."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # inherited by the server process only
    with run_server(model, tmp_path, *extra) as server:
        monkeypatch.delenv("TMPDIR")
        yield server, tmpdir
