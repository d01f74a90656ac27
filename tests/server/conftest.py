"""Real `rackserve serve` processes on 127.0.0.1 (free port) over the tiny random model."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
# Small enough to start in seconds on 2 CPU cores, large enough for 64 concurrent streams.
ENGINE_ARGS = (
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "72",
    "--max-num-batched-tokens", "1024", "--kv-cache-memory", "64M",
)  # fmt: skip
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (any thread) from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def pid_alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        for pid in child_pids(self.process.pid):
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        raise AssertionError(f"no engine process under {self.process.pid}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("models") / "tiny")


@contextlib.contextmanager
def run_server(model: Path, tmp_path: Path, *extra: str) -> Iterator[Server]:
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", str(model), "--port", str(port),
        "--served-model-name", MODEL_NAME, "--disable-uvicorn-access-log", *ENGINE_ARGS, *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited during start-up:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"server not healthy in time:\n{server.log()}")
            time.sleep(0.25)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server shared by the API tests (the lifecycle tests start their own)."""
    tmp = tmp_path_factory.mktemp("api")
    extra = ("--api-key", API_KEY, "--max-request-body-bytes", "64K")
    with run_server(tiny_model, tmp, *extra) as server:
        yield server


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
