"""Real `rackserve serve` / `rackserve router` processes on loopback (tiny model)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from rackserve.parallel.groups import free_port

ENGINE_ARGS = (
    "--max-model-len", "1024", "--max-num-seqs", "48", "--max-num-batched-tokens", "512",
    "--kv-cache-memory", "32M", "--disable-uvicorn-access-log", "--served-model-name", "tiny",
    "--disable-log-stats",
)  # fmt: skip
STARTUP_TIMEOUT_S = 180


async def serve_router_app(router) -> tuple[object, str]:
    """The router's aiohttp app on a free loopback port, in this event loop (fake engines
    in process): (its AppRunner, to ``cleanup()``; its URL)."""
    from aiohttp import web

    runner = web.AppRunner(router.build_app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Proc:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the process group (server and its engine process)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def _start(cmd: list[str], port: int, tmp_path: Path, name: str) -> Proc:
    log_path = tmp_path / f"{name}-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True
        )
    return Proc(process, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(procs: list[Proc], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        proc = pending[0]
        if proc.process.poll() is not None:
            raise AssertionError(f"{proc.url} exited during start-up:\n{proc.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{proc.url}/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.url} not healthy in time:\n{proc.log()}")
        time.sleep(0.25)


def start_engine(model: Path, tmp_path: Path, *extra: str, port: int | None = None) -> Proc:
    port = port or free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", str(model), "--port", str(port),
        *ENGINE_ARGS, *extra,
    ]  # fmt: skip
    return _start(cmd, port, tmp_path, "engine")


def kv_config(role: str, **kwargs) -> str:
    config = {"kv_role": role, "kv_connector": "tcp", **kwargs}
    if role == "kv_producer":
        config.setdefault("kv_port", free_port())
    return json.dumps(config)


def start_router(tmp_path: Path, *args: str) -> Proc:
    port = free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "router", "--port", str(port),
        "--health-interval", "0.25", *args,
    ]  # fmt: skip
    return _start(cmd, port, tmp_path, "router")


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[tuple[Proc, ...]]:
    try:
        wait_healthy(list(procs))
        yield procs
    finally:
        for proc in procs:
            proc.stop()
