"""`make demo`: serve the embedded tiny model, chat with it, benchmark it, stop; then the
same through prefill/decode disaggregation.

Creates the tiny random-weight checkpoint under ``./models/tiny`` when missing, starts
``rackserve serve`` on a free loopback port, sends a few chat requests (one streaming),
runs a short agentic benchmark (about 25 s) and writes its JSON and plots under
``./out/demo/``, then stops the server with SIGTERM (the same drain path as production).
Then 1 prefill + 1 decode engine + the router (disagg/demo.py, about 1 min): the agentic
benchmark through the router, and where each request's KV came from.
The weights are random, so the answers are word salad; the point is the whole path.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

MODEL_DIR = Path("models/tiny")
OUT_DIR = Path("out/demo")
MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 180.0
SERVER_ARGS = (
    "--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
    "--kv-cache-memory", "128M", "--disable-uvicorn-access-log",
)  # fmt: skip
QUESTIONS = ("What is a mixture of experts?", "Name three prime numbers.")


class DemoError(RuntimeError):
    """A demo step failed; the message says which and where to look."""


def ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").exists():
        return
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    print(f"creating the tiny random-weight model in {model_dir} ...", flush=True)
    create_checkpoint(tiny_config(), model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DemoError(f"the server exited during start-up; see {log_path}:\n{tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise DemoError(f"the server was not healthy after {STARTUP_TIMEOUT_S:.0f} s; see {log_path}")


def tail(path: Path, num_lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    return ""


@contextlib.contextmanager
def running_server(model_dir: Path, out_dir: Path) -> Iterator[str]:
    """Start the server; always stop it (SIGTERM, then SIGKILL after 30 s)."""
    port = free_port()
    log_path = out_dir / "server.log"
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", str(model_dir), "--port", str(port),
        "--served-model-name", MODEL_NAME, *SERVER_ARGS,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    print(f"server starting on {base_url} (log: {log_path}) ...", flush=True)
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        print(f"server stopped (exit code {process.returncode})", flush=True)


def chat(base_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    print(
        "\nnote: the embedded model has random weights, so its replies are noise by design; "
        "what the demo shows is the serving path (API, scheduler, KV cache, streaming)."
    )
    for question in QUESTIONS:
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": question}],
            max_tokens=24,
            temperature=0.7,
            seed=0,
        )
        usage = response.usage
        print(f"\nuser: {question}\nassistant: {response.choices[0].message.content!r}")
        print(f"  ({usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens)")
    question = "Stream a short poem."
    print(f"\nuser: {question}\nassistant (streaming): ", end="", flush=True)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            print(repr(choice.delta.content or "")[1:-1], end="", flush=True)
        if chunk.usage is not None:
            print(f"\n  ({chunk.usage.completion_tokens} tokens streamed)")


def format_cpu_report(result: dict) -> str:
    """The agentic report worded for a CPU run: no GPU count, throughput in tok/s."""
    from rackserve.bench.metrics import summary_row
    from rackserve.bench.report import AGENTIC_COLUMNS, format_table

    trace = result["trace"]
    columns = [
        ("tok_s_per_gpu", "tok/s", 1) if key == "tok_s_per_gpu" else (key, header, digits)
        for key, header, digits in AGENTIC_COLUMNS
    ]  # with num_gpus 1, "per GPU" is the whole server's throughput
    rows = [summary_row(level) for level in result["levels"]]
    return "\n".join(
        [
            f"agentic benchmark on CPU: {result['model']} at {result['base_url']} "
            f"({result['duration_s']:g} s window per level)",
            f"trace: {trace['num_requests']} requests in {trace['num_sessions']} sessions, "
            f"mean input {trace['mean_input_tokens']:.0f} tokens",
            format_table(rows, columns),
            f"hit rate: measured share of prompt tokens the server found in its prefix cache; "
            f"the trace's theoretical rate ({trace['theoretical_prefix_hit_rate']:.3f}) "
            "assumes an infinite cache and every earlier turn already sent.",
        ]
    )


def benchmark(base_url: str, out_dir: Path) -> None:
    from rackserve.bench.agentic import AgenticRunConfig, run_agentic
    from rackserve.bench.report import format_agentic_report, write_agentic_outputs
    from rackserve.bench.workloads import AgenticConfig

    print("\nagentic benchmark (concurrency 1 and 4, 2 s warm-up + 10 s each) ...", flush=True)
    workload = AgenticConfig(scale=0.05, think_time_s=0.0)
    run = AgenticRunConfig(concurrency=(1, 4), warmup_s=2, duration_s=10, progress=False)
    result = run_agentic(workload, base_url, run, model=MODEL_NAME)
    on_cpu = not _has_accelerator()
    print(format_cpu_report(result) if on_cpu else format_agentic_report(result))
    paths = write_agentic_outputs(result, out_dir / "agentic.json")
    print("wrote " + ", ".join(str(p) for p in paths))


def _has_accelerator() -> bool:
    from rackserve.device import default_device

    return default_device() != "cpu"


def main(pd: bool = True) -> int:
    """The aggregated demo, then (``pd``) the P/D one; the exit code of the first failure."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    try:
        ensure_model(MODEL_DIR)
        with running_server(MODEL_DIR, OUT_DIR) as base_url:
            chat(base_url)
            benchmark(base_url, OUT_DIR)
        if pd:
            from rackserve.disagg.demo import main as pd_main

            print("\n== prefill/decode disaggregation: 1 prefill + 1 decode engine + router ==")
            return pd_main()
    except (DemoError, OSError, ValueError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
