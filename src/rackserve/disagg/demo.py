"""`rackserve demo --pd`: 1 prefill engine + 1 decode engine + the router, on loopback.

Starts the three processes at once over the tiny model (``./models/tiny``, created when
missing; the router with ``--overlap-transfer``: decode requests go out with the prefill
ones once it knows the prefill engine's KV address),
runs a short agentic benchmark through the router, then a few agent turns printing where
each request's KV came from (the router's ``X-KV-Source``: the prefill engine, or the
decode engine itself) with its cached tokens, and the decode side's KV bytes received.
Logs and the benchmark's JSON go to ``./out/demo-pd/``. (`rackserve demo` alone, which
`make demo` runs, shows the aggregated demo first, then this one.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from rackserve.demo import (
    MODEL_DIR,
    MODEL_NAME,
    DemoError,
    ensure_model,
    free_port,
    wait_healthy,
)

OUT_DIR = Path("out/demo-pd")
ENGINE_ARGS = (
    "--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024",
    "--kv-cache-memory", "64M", "--disable-uvicorn-access-log", "--disable-log-stats",
    "--served-model-name", MODEL_NAME,
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="the demo (`make demo`: aggregated, then P/D); --pd: only P/D"
    )
    p.add_argument("--pd", action="store_true", help="only 1 prefill + 1 decode engine + router")
    p.set_defaults(func=lambda args: main() if args.pd else _both())


def _both() -> int:
    """`make demo`: the aggregated demo, then this one."""
    from rackserve.demo import main as aggregated_main

    return aggregated_main()


@contextlib.contextmanager
def processes(specs: list[tuple[list[str], str, str]]) -> Iterator[None]:
    """Start every (cmd, name, url) at once (their start-ups overlap), wait until each is
    healthy in order; always stop them (SIGTERM, then SIGKILL after 30 s)."""
    started: list[subprocess.Popen] = []
    try:
        for cmd, name, url in specs:
            log_path = OUT_DIR / f"{name}.log"
            with open(log_path, "wb") as log:
                started.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            print(f"{name} starting on {url} (log: {log_path}) ...", flush=True)
        for proc, (_, name, url) in zip(started, specs, strict=True):
            wait_healthy(proc, url, OUT_DIR / f"{name}.log")
        yield
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def engine(role: str) -> tuple[list[str], str]:
    port = free_port()
    config: dict = {"kv_role": role, "kv_connector": "tcp"}
    if role == "kv_producer":
        config["kv_port"] = free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", str(MODEL_DIR), "--port", str(port),
        *ENGINE_ARGS, "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    return cmd, f"http://127.0.0.1:{port}"


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


def kv_sources(router: str) -> dict[str, float]:
    """The router's rackserve_router_kv_source_total by source label."""
    import httpx

    out = {}
    for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
        if line.startswith("rackserve_router_kv_source_total{"):
            label = line.split('source="', 1)[1].split('"', 1)[0]
            out[label] = float(line.split()[-1])
    return out


def agent_turns(router: str, decode: str, num_sessions: int = 3, num_turns: int = 3) -> None:
    import httpx

    print("\nwhere each request's KV came from (agent turns: prompt + output + new text):")
    print(f"{'session':>7} {'turn':>4} {'prompt':>6} {'cached':>6} {'KV bytes in':>11}  source")
    prompts = [f"Session {s}: list the files, then read the largest one." for s in range(3)]
    for turn in range(num_turns):
        for s in range(num_sessions):
            before = metric(decode, "rackserve:kv_transfer_bytes_received_total")
            body = {"model": MODEL_NAME, "prompt": prompts[s], "max_tokens": 24, "temperature": 0}
            r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
            if r.status_code != 200:
                raise DemoError(f"the router answered {r.status_code}: {r.text[:200]}")
            data = r.json()
            usage = data["usage"]
            received = metric(decode, "rackserve:kv_transfer_bytes_received_total") - before
            print(
                f"{s:>7} {turn:>4} {usage['prompt_tokens']:>6} "
                f"{usage['prompt_tokens_details']['cached_tokens']:>6} {received:>11.0f}  "
                f"{r.headers.get('X-KV-Source', '?')}",
                flush=True,
            )
            prompts[s] += data["choices"][0]["text"] + " Now run the tests."


def benchmark(router: str) -> None:
    from rackserve.bench.agentic import AgenticRunConfig, run_agentic
    from rackserve.bench.report import write_agentic_outputs
    from rackserve.bench.workloads import AgenticConfig
    from rackserve.demo import format_cpu_report

    print("\nagentic benchmark through the router (concurrency 4, 10 s) ...", flush=True)
    workload = AgenticConfig(scale=0.05, think_time_s=0.0)
    run = AgenticRunConfig(concurrency=(4,), warmup_s=2, duration_s=10, progress=False)
    result = run_agentic(workload, router, run, model=MODEL_NAME)
    print(format_cpu_report(result))
    sources = kv_sources(router)
    print("where the benchmark's requests' KV came from (router): " + ", ".join(
        f"{source}: {count:.0f}" for source, count in sources.items()
    ))  # fmt: skip
    paths = write_agentic_outputs(result, OUT_DIR / "agentic.json")
    print("wrote " + ", ".join(str(p) for p in paths))


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    try:
        ensure_model(MODEL_DIR)
        prefill_cmd, prefill_url = engine("kv_producer")
        decode_cmd, decode_url = engine("kv_consumer")
        router_port = free_port()
        router_cmd = [
            sys.executable, "-m", "rackserve.cli", "router", "--port", str(router_port),
            "--prefill", prefill_url, "--decode", decode_url, "--overlap-transfer",
        ]  # fmt: skip
        router_url = f"http://127.0.0.1:{router_port}"
        with processes(
            [
                (prefill_cmd, "prefill", prefill_url),
                (decode_cmd, "decode", decode_url),
                (router_cmd, "router", router_url),
            ]
        ):
            benchmark(router_url)
            agent_turns(router_url, decode_url)
            total = metric(decode_url, "rackserve:kv_transfer_bytes_received_total")
            print(
                f"\ndecode engine: {total / 2**20:.1f} MiB of KV received from the prefill engine"
            )
    except (DemoError, OSError, ValueError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
