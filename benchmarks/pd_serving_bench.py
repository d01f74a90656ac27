"""P/D serving figures: TTFT of disaggregation against one aggregated engine at low load,
and the inter-token latency of running streams when a burst of requests arrives, with and
without the decode side's admission cap.

    python benchmarks/pd_serving_bench.py --model DIR --out pd_serving.json

Engines: aggregated on GPU 0; prefill on GPU 0 and decode on GPU 1 (both on GPU 0, with
half the memory each, when one GPU is visible); NCCL transport; the router in front.
CPU smoke run: ``--device cpu --lengths 64,256 --burst 8 --transport tcp``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def proc(cmd: list[str], url: str, log: Path, env: dict | None = None):
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or dict(os.environ))
    try:
        deadline = time.monotonic() + 900
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"{cmd[3]} exited; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy in time; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def engine(args, gpu: str, role: str | None, log: Path, cap: int | None = None, share=1.0):
    port = free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", args.model, "--port", str(port),
        "--served-model-name", "m",
        "--max-model-len", str(max(*args.lengths, args.burst_length) + 512),
        "--disable-uvicorn-access-log", "--disable-log-stats", "--device", args.device,
    ]  # fmt: skip
    if args.device == "cuda":
        cmd += ["--gpu-memory-utilization", f"{0.85 * share:.2f}"]
    else:
        cmd += ["--kv-cache-memory", "256M"]
    if role is not None:
        config = {"kv_role": role, "kv_connector": args.transport}
        if role == "kv_producer":
            config["kv_port"] = free_port()
        cmd += ["--kv-transfer-config", json.dumps(config)]
    if cap is not None:
        cmd += ["--max-kv-loads-per-step", str(cap)]
    if role == "kv_producer" and args.prefill_chunk:  # its KV streams while later chunks run
        cmd += ["--long-prefill-token-threshold", str(args.prefill_chunk)]
    cmd += args.engine_arg
    env = dict(os.environ)
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return proc(cmd, f"http://127.0.0.1:{port}", log, env)


# the routers measured beside the default one: the decode request sent with the prefill one
# (the transfer overlaps the prefill's chunks), and every chunk from the decode engine (the
# first token not sent from the prefill engine's answer)
ALT_ROUTERS = {"overlap": "--overlap-transfer", "plain": "--no-first-token-from-prefill"}


def router(prefill: str, decode: str, log: Path, flag: str | None = None):
    port = free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "router", "--port", str(port),
        "--prefill", prefill, "--decode", decode, *([flag] if flag else []),
    ]  # fmt: skip
    return proc(cmd, f"http://127.0.0.1:{port}", log)


@functools.cache
def _client() -> httpx.Client:
    """One client for every request (thread-safe): ``httpx.stream`` builds a client per call,
    and building one (its SSL context) took 17-30 ms on the CI host, inside every TTFT
    measured before 2026-12-02's session 12."""
    return httpx.Client(timeout=600)


def stream(base: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of each streamed chunk; [0] is the request's start.
    With logprobs asked for, every token is a chunk of its own: a random checkpoint samples
    many ids its tokenizer decodes to no text, and the server sends no chunk for those."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 1}  # fmt: skip
    client = _client()
    times = [time.perf_counter()]
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 10 for i in range(length)]


def ttft(
    base: str, lengths: list[int], repeats: int, seed: int, second: dict | None = None
) -> dict[int, float]:
    """Median TTFT per prompt length, after one untimed request of each length (the first
    request of a length pays one-off costs: kernel compiles for its shapes, allocations).
    ``second`` gets the median time to the second token (P/D: the first comes with the
    prefill engine's answer, the second waits for the KV and the decode side's step)."""
    for length in lengths:
        stream(base, prompt_of(length, seed + 500), 2)
    out = {}
    for length in lengths:
        values = []
        for r in range(repeats):
            values.append(stream(base, prompt_of(length, seed + r), 4))  # new prompts: no hits
        out[length] = statistics.median(t[1] - t[0] for t in values)
        if second is not None:
            second[length] = statistics.median(t[2] - t[0] for t in values)
    return out


def _sums(
    url: str, names: tuple[str, ...], prefix: str = "rackserve:"
) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in a server's /metrics (an engine's names start with
    "rackserve:", the router's with "rackserve_router_")."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in names:
        values = [0.0, 0.0]
        for line in text.splitlines():
            for k, suffix in enumerate(("_sum", "_count")):
                if line.startswith(f"{prefix}{name}{suffix}"):
                    values[k] += float(line.split()[-1])
        out[name] = (values[0], values[1])
    return out


def _mean_since(before: dict, after: dict, name: str) -> float | None:
    count = after[name][1] - before[name][1]
    return (after[name][0] - before[name][0]) / count if count else None


def pd_ttft_parts(base: str, pre: str, dec: str, lengths: list[int], repeats: int, seed: int):
    """P/D TTFT per length (median, as ``ttft``) and where it goes, as the engines' own
    histograms saw it over the same requests (means): the prefill engine's TTFT (its
    prompt's compute) and the decode engine's queue time (arrival to first scheduled: the
    wait for the KV, then admission)."""
    for length in lengths:
        stream(base, prompt_of(length, seed + 500), 2)
    names = ("time_to_first_token_seconds", "request_queue_time_seconds")
    hops = ("prefill_seconds", "first_byte_seconds")
    medians, parts = {}, {}
    for length in lengths:
        p0, d0 = _sums(pre, names), _sums(dec, names)
        r0 = _sums(base, hops, "rackserve_router_")
        values = [stream(base, prompt_of(length, seed + r), 4) for r in range(repeats)]
        p1, d1 = _sums(pre, names), _sums(dec, names)
        r1 = _sums(base, hops, "rackserve_router_")
        medians[length] = statistics.median(t[1] - t[0] for t in values)
        parts[length] = {
            "second_token_s": statistics.median(t[2] - t[0] for t in values),
            "prefill_engine_ttft_s": _mean_since(p0, p1, names[0]),
            "decode_engine_ttft_s": _mean_since(d0, d1, names[0]),
            "decode_queue_s": _mean_since(d0, d1, names[1]),
            # the router's view: its prefill request's round trip, and the client's request
            # received to the decode side's first byte sent on
            "router_prefill_s": _mean_since(r0, r1, hops[0]),
            "router_first_byte_s": _mean_since(r0, r1, hops[1]),
        }
    return medians, parts


def steady_itl(base: str, tokens: int) -> dict:
    """The ITL of 8 streams decoding together with nothing arriving: the floor a burst's
    ITL is read against."""
    gaps: list[float] = []

    def runner(i: int) -> None:
        times = stream(base, prompt_of(128, 900 + i), tokens)
        gaps.extend(b - a for a, b in itertools.pairwise(times[1:]))

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gaps.sort()
    return {"p50_ms": 1e3 * gaps[len(gaps) // 2], "p99_ms": 1e3 * gaps[int(0.99 * len(gaps))],
            "count": len(gaps)}  # fmt: skip


def burst_itl(base: str, args) -> dict:
    """8 streams decoding; then ``args.burst`` requests at once; ITL of the 8 during it."""
    burst_window: list[float] = []
    gaps_at: list[tuple[float, float]] = []  # (arrival, gap since the previous chunk)
    failed: list[int] = []  # HTTP statuses of burst requests that did not succeed

    def runner(i: int) -> None:
        times = stream(base, prompt_of(128, 1000 + i), args.running_tokens)
        gaps_at.extend((b, b - a) for a, b in itertools.pairwise(times[1:]))

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(args.burst_delay_s)
    burst_window.append(time.perf_counter())
    length = args.burst_length
    with httpx.Client(timeout=600) as client:

        def one(i: int) -> None:
            r = client.post(f"{base}/v1/completions", json={
                "model": "m", "prompt": prompt_of(length, 5000 + i), "max_tokens": 4,
                "temperature": 0})  # fmt: skip
            if r.status_code != 200:
                failed.append(r.status_code)

        burst = [threading.Thread(target=one, args=(i,)) for i in range(args.burst)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
    burst_window.append(time.perf_counter())
    for t in threads:
        t.join()
    during = [g for at, g in gaps_at if burst_window[0] <= at <= burst_window[1] + 0.5]
    before = [g for at, g in gaps_at if at < burst_window[0]]

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        values = sorted(values)
        return {"p50_ms": 1e3 * values[len(values) // 2],
                "p99_ms": 1e3 * values[min(len(values) - 1, int(0.99 * len(values)))],
                "max_ms": 1e3 * values[-1], "count": len(values)}  # fmt: skip

    if failed:
        print(f"burst: {len(failed)} requests failed (HTTP {sorted(set(failed))})", flush=True)
    return {"before_burst": stats(before), "during_burst": stats(during),
            "burst_s": burst_window[1] - burst_window[0], "burst_failed": len(failed)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--transport", default="nccl")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--burst-length", type=int, default=4096)
    p.add_argument("--burst-delay-s", type=float, default=3.0)
    p.add_argument("--running-tokens", type=int, default=400)
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="the prefill engine's --long-prefill-token-threshold (0: off)")  # fmt: skip
    p.add_argument(
        "--alt-routers",
        default="plain,overlap",
        help=f"routers measured beside the default one: of {sorted(ALT_ROUTERS)}",
    )
    p.add_argument("--engine-arg", action="append", default=[],
                   help="one more argument of every engine's serve (repeat it)")  # fmt: skip
    p.add_argument("--ttft-only", action="store_true",
                   help="TTFT alone: no steady ITL, no bursts, the capped pair")  # fmt: skip
    p.add_argument("--logs", type=Path, default=Path("."))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.alt_routers = [x for x in args.alt_routers.split(",") if x]
    args.logs.mkdir(parents=True, exist_ok=True)
    decode_gpu, share = ("1", 1.0) if args.gpus > 1 else ("0", 0.5)
    result: dict = {"lengths": args.lengths, "gpus": args.gpus, "transport": args.transport}

    def save() -> None:  # after every section: a call cut short keeps what it measured
        args.out.write_text(json.dumps(result, indent=1))

    with engine(args, "0", None, args.logs / "aggregated.log") as agg:
        ttft(agg, args.lengths[:1], 1, seed=1)  # warm-up (graphs, allocator)
        result["second_token_aggregated_s"] = {}
        result["ttft_aggregated_s"] = ttft(
            agg, args.lengths, args.repeats, seed=10, second=result["second_token_aggregated_s"]
        )
        print("aggregated TTFT", result["ttft_aggregated_s"], flush=True)
        if not args.ttft_only:
            result["steady_itl_aggregated"] = steady_itl(agg, 200)
            print("aggregated ITL of 8 streams", result["steady_itl_aggregated"], flush=True)
    save()
    for cap in (4,) if args.ttft_only else (4, 0):
        with (
            engine(args, "0", "kv_producer", args.logs / f"prefill{cap}.log", share=share) as pre,
            engine(
                args, decode_gpu, "kv_consumer", args.logs / f"decode{cap}.log", cap, share
            ) as dec,
            router(pre, dec, args.logs / f"router{cap}.log") as base,
        ):
            ttft(base, args.lengths[:1], 1, seed=2)
            if cap and not args.ttft_only:
                result["steady_itl_pd"] = steady_itl(base, 200)
                print("P/D ITL of 8 streams", result["steady_itl_pd"], flush=True)
            if cap:
                pd, result["ttft_pd_parts"] = pd_ttft_parts(
                    base, pre, dec, args.lengths, args.repeats, seed=10
                )
                result["ttft_pd_s"] = pd
                result["ttft_overhead"] = {
                    n: pd[n] / result["ttft_aggregated_s"][n] - 1 for n in args.lengths
                }
                print("P/D TTFT", pd, "overhead", result["ttft_overhead"], flush=True)
                print("  where it went", result["ttft_pd_parts"], flush=True)
                save()
                for name in args.alt_routers:
                    flag = ALT_ROUTERS[name]
                    with router(pre, dec, args.logs / f"router_{name}.log", flag) as alt:
                        ttft(alt, args.lengths[:1], 2, seed=3)  # overlap: teaches the address
                        pd, result[f"ttft_pd_{name}_parts"] = pd_ttft_parts(
                            alt, pre, dec, args.lengths, args.repeats, seed=20
                        )
                    result[f"ttft_pd_{name}_s"] = pd
                    result[f"ttft_{name}_overhead"] = {
                        n: pd[n] / result["ttft_aggregated_s"][n] - 1 for n in args.lengths
                    }
                    print(f"P/D TTFT, router {flag}", pd, result[f"ttft_{name}_overhead"])
                    print("  where it went", result[f"ttft_pd_{name}_parts"], flush=True)
                    save()
            if not args.ttft_only:
                result[f"burst_itl_cap{cap}"] = burst_itl(base, args)
                print(f"ITL under a burst, cap {cap}:", result[f"burst_itl_cap{cap}"], flush=True)
                save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
