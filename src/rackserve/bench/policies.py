"""``bench agentic --compare-policies``: the agentic workload through ``rackserve router``
once per routing policy over the same engines, and a plot of hit rate and TTFT by policy.

For each policy a router process is started on a free port over ``--engines`` (plus every
``--router-arg``, e.g. ``--kv-events``), one agentic run goes through it and the router
stops. Each policy plays fresh sessions (disjoint session numbers), so no policy finds
another's prompts cached, apart from the system prompt every session shares::

    policy 1:  router(--policy kv-aware)    -> agentic run, sessions [0, ...)
    policy 2:  router(--policy round-robin) -> agentic run, sessions [1e6, ...)
    ...        (the same engines throughout)
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rackserve.bench.agentic import AgenticRunConfig, run_agentic
from rackserve.bench.workloads import AgenticConfig, TokenCounter

SESSION_STRIDE = 1_000_000  # session numbers per policy: disjoint ranges, fresh users
ROUTER_STARTUP_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_router(
    engines: Sequence[str], policy: str, router_args: Sequence[str] = ()
) -> Iterator[str]:
    """A ``rackserve router`` process over ``engines`` with ``policy``; yields its URL
    once healthy, stops it on exit. RuntimeError (with its log) when it does not start."""
    import httpx

    port = _free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "router", "--engines", ",".join(engines),
        "--policy", policy, "--port", str(port), "--health-interval", "0.5", *router_args,
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ROUTER_STARTUP_S
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    text = log.read().decode(errors="replace")[-4000:]
                    raise RuntimeError(f"the {policy} router did not start:\n{text}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.25)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def check_engines(engines: Sequence[str], timeout_s: float = 5.0) -> None:
    """ValueError naming the first engine whose /health does not answer 200 (a router
    over it would report itself unhealthy, and the run would measure nothing)."""
    import httpx

    for url in engines:
        try:
            status = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code
        except httpx.HTTPError as e:
            raise ValueError(f"engine {url} cannot be reached ({e})") from None
        if status != 200:
            raise ValueError(f"engine {url} is not healthy (/health answered {status})")


def policy_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """One policy's figures from its agentic result (first concurrency level)."""
    level = result["levels"][0]
    theoretical = level.get("theoretical_prefix_hit_rate_measured")
    hit = level.get("prefix_hit_rate")
    return {
        "hit_rate": hit,
        "theoretical_hit_rate": theoretical,
        "fraction_of_theoretical": hit / theoretical if hit is not None and theoretical else None,
        "ttft_p50_ms": level["ttft_ms"]["p50"],
        "ttft_p90_ms": level["ttft_ms"]["p90"],
        "num_completed": level["num_completed"],
        "num_failed": level["num_failed"],
    }


def compare_policies(
    workload: AgenticConfig,
    engines: Sequence[str],
    policies: Sequence[str],
    run: AgenticRunConfig,
    *,
    router_args: Sequence[str] = (),
    model: str | None = None,
    counter: TokenCounter | None = None,
) -> dict[str, Any]:
    """Run the workload through a router per policy; ``{"policies": {name: row}, "runs":
    {name: agentic result}}``, rows as :func:`policy_row`."""
    from rackserve.router.policies import POLICIES

    if not engines:
        raise ValueError("--compare-policies needs --engines URL,... (the engines to route over)")
    if len(set(policies)) != len(policies) or not policies:
        raise ValueError(f"--compare-policies: give distinct policies, got {list(policies)}")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--compare-policies: unknown policy {unknown[0]!r}; one of {POLICIES}")
    check_engines(engines)
    runs = {}
    for i, policy in enumerate(policies):
        with running_router(engines, policy, router_args) as url:
            runs[policy] = run_agentic(
                workload, url, run, model=model, counter=counter, first_session=i * SESSION_STRIDE
            )
    return {
        "benchmark": "agentic-policies",
        "engines": list(engines),
        "router_args": list(router_args),
        "policies": {name: policy_row(result) for name, result in runs.items()},
        "runs": runs,
    }


def format_policy_report(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        f"{'policy':<12} {'hit rate':>8} {'theory':>7} {'ratio':>6} {'TTFT p50':>9} "
        f"{'TTFT p90':>9} {'done':>5} {'failed':>6}"
    ]
    for name, r in rows.items():
        lines.append(
            f"{name:<12} {num(r['hit_rate'], '.3f'):>8} {num(r['theoretical_hit_rate'], '.3f'):>7}"
            f" {num(r['fraction_of_theoretical'], '.1%'):>6} {num(r['ttft_p50_ms'], '.0f'):>9}"
            f" {num(r['ttft_p90_ms'], '.0f'):>9} {r['num_completed']:>5} {r['num_failed']:>6}"
        )
    return "\n".join(lines)


def plot_policies(rows: Mapping[str, Mapping[str, Any]], path: str | Path) -> Any:
    """Two panels, one bar per policy in each: the measured prefix-hit rate (the
    theoretical rate of the requests measured as a marker) and P90 TTFT (P50 as a marker).
    Writes a PNG (Agg, no display needed) and returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(rows)
    x = range(len(names))

    def values(key: str) -> list[float]:
        return [float("nan") if rows[n][key] is None else rows[n][key] for n in names]

    figure = Figure(figsize=(4 + 1.2 * len(names), 4), layout="constrained")
    FigureCanvasAgg(figure)
    hits, ttft = figure.subplots(1, 2)
    hits.bar(x, values("hit_rate"), color="tab:blue", label="measured")
    hits.plot(x, values("theoretical_hit_rate"), "k_", markersize=30, label="theoretical")
    hits.set_ylim(0, 1.15)  # room for the legend above the bars
    hits.set_ylabel("prefix-hit rate (cached / prompt tokens)")
    ttft.bar(x, values("ttft_p90_ms"), color="tab:orange", label="P90")
    ttft.plot(x, values("ttft_p50_ms"), "k_", markersize=30, label="P50")
    ttft.set_ylabel("TTFT (ms)")
    top = max((v for v in values("ttft_p90_ms") if v == v), default=1.0)  # v == v: not NaN
    ttft.set_ylim(0, 1.2 * top)
    for ax in (hits, ttft):
        ax.legend(loc="upper center", ncols=2, fontsize="small")
    for ax, title in ((hits, "prefix-hit rate by policy"), (ttft, "TTFT by policy")):
        ax.set_xticks(list(x), names)
        ax.set_title(title)
    figure.savefig(path, dpi=100)
    return figure


def compare_main(
    args: Any, workload: AgenticConfig, run: AgenticRunConfig, counter: TokenCounter | None
) -> int:
    """``bench agentic --compare-policies``: run, print the table, write JSON and plot."""
    from rackserve.bench.report import write_json

    policies = [p.strip() for p in args.compare_policies.split(",") if p.strip()]
    engines = [u.strip() for u in (args.engines or "").split(",") if u.strip()]
    result = compare_policies(
        workload, engines, policies, run, router_args=args.router_arg, model=args.model,
        counter=counter,
    )  # fmt: skip
    print(format_policy_report(result["policies"]))
    if args.output:
        print(f"wrote {write_json(result, args.output)}")
    if args.plot:
        plot_policies(result["policies"], args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["num_completed"] for r in result["policies"].values()) else 1
