"""Benchmark output: JSON files, a text table, and PNG plots (matplotlib, no GUI backend).

Plots use ``matplotlib.figure.Figure`` directly rather than ``pyplot``, so they need no
display, set no global backend, and leave no figure registered after saving.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rackserve.bench.metrics import summary_row


def write_json(result: Mapping[str, Any] | Sequence[Any], path: str | Path) -> Path:
    """Write ``result`` as indented JSON (NaN/inf become null, keeping the file standard)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, int]]) -> str:
    """A fixed-width text table; ``columns`` are ``(key, header, decimal digits)``."""
    cells = [[header for _, header, _ in columns]]
    cells += [[_cell(row.get(key), digits) for key, _, digits in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


AGENTIC_COLUMNS = (
    ("concurrency", "conc", 0),
    ("tok_s_per_gpu", "tok/s/GPU", 1),
    ("output_tok_s", "out tok/s", 1),
    ("interactivity", "P90 tok/s/user", 1),
    ("ttft_p50_ms", "TTFT p50 ms", 1),
    ("ttft_p90_ms", "TTFT p90 ms", 1),
    ("itl_p90_ms", "ITL p90 ms", 2),
    ("hit_rate", "hit rate", 3),
    ("completed", "done", 0),
    ("failed", "failed", 0),
)


def format_agentic_report(result: Mapping[str, Any]) -> str:
    """The agentic result as a short text report: trace facts, then one row per level."""
    trace = result["trace"]
    header = (
        f"agentic benchmark: {result['model']} at {result['base_url']} "
        f"({result['num_gpus']} GPU(s), {result['duration_s']:g} s window per level)\n"
        f"trace: {trace['num_requests']} requests in {trace['num_sessions']} sessions, "
        f"mean input {trace['mean_input_tokens']:.0f} tokens, "
        f"theoretical prefix-hit rate {trace['theoretical_prefix_hit_rate']:.3f}"
    )
    rows = [summary_row(level) for level in result["levels"]]
    errors = sorted({e for level in result["levels"] for e in level["failure_examples"]})
    return "\n".join([header, format_table(rows, AGENTIC_COLUMNS), *_failures(errors)])


def _failures(errors: Sequence[str]) -> list[str]:
    return [f"failure: {e}" for e in errors[:5]]


SERVE_COLUMNS = (
    ("completed", "completed", 0),
    ("failed", "failed", 0),
    ("duration", "duration s", 2),
    ("request_throughput", "req/s", 2),
    ("output_throughput", "out tok/s", 1),
    ("total_token_throughput", "total tok/s", 1),
    ("mean_ttft_ms", "mean TTFT ms", 1),
    ("median_ttft_ms", "median TTFT ms", 1),
    ("mean_tpot_ms", "mean TPOT ms", 2),
    ("mean_itl_ms", "mean ITL ms", 2),
)


def format_serve_report(result: Mapping[str, Any]) -> str:
    lines = [format_table([result], SERVE_COLUMNS)]
    return "\n".join(lines + _failures(result.get("failure_examples", [])))


def plot_pareto(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Throughput per GPU vs P90 interactivity, one point per concurrency, one line per run.

    Several results (for example two servers) can share the plot; each is labelled
    with its model and base URL.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 5), layout="constrained")
    axes = figure.add_subplot()
    for result in results:
        rows = [summary_row(level) for level in result["levels"]]
        rows = [r for r in rows if r["interactivity"] is not None]
        x = [r["interactivity"] for r in rows]
        y = [r["tok_s_per_gpu"] for r in rows]
        axes.plot(x, y, marker="o", label=f"{result['model']} @ {result['base_url']}")
        for r in rows:
            axes.annotate(f"c={r['concurrency']}", (r["interactivity"], r["tok_s_per_gpu"]))
    axes.set_xlabel("interactivity: 1 / P90 inter-token latency (tok/s per user)")
    axes.set_ylabel("throughput per GPU (cached + uncached input + output tok/s)")
    axes.margins(0.12)  # room for the concurrency labels at the ends
    axes.set_title("agentic benchmark: throughput vs interactivity")
    axes.grid(True, alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small")
    return _save(figure, path)


def plot_ttft_cdf(result: Mapping[str, Any], path: str | Path) -> Path:
    """The TTFT distribution of every concurrency level as a CDF (log time axis)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 5), layout="constrained")
    axes = figure.add_subplot()
    for level in result["levels"]:
        cdf = level["ttft_cdf_ms"]
        if cdf:
            levels = [i / (len(cdf) - 1) for i in range(len(cdf))] if len(cdf) > 1 else [1.0]
            axes.plot(cdf, levels, label=f"concurrency {level['concurrency']}")
    axes.set_xlabel("time to first token (ms)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(f"TTFT CDF: {result['model']}")
    axes.grid(True, alpha=0.3)
    if axes.lines:  # TTFTs span decades between low and high concurrency
        axes.set_xscale("log")
        axes.legend(fontsize="small")
    return _save(figure, path)


def _save(figure: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def plot_paths(output: str | Path) -> tuple[Path, Path]:
    """``run.json`` -> ``run_pareto.png`` and ``run_ttft_cdf.png`` beside it."""
    output = Path(output)
    stem = output.with_suffix("")
    return Path(f"{stem}_pareto.png"), Path(f"{stem}_ttft_cdf.png")


def write_agentic_outputs(result: Mapping[str, Any], output: str | Path) -> list[Path]:
    """The JSON result plus its Pareto plot and TTFT CDF; returns the paths written."""
    pareto, cdf = plot_paths(output)
    return [write_json(result, output), plot_pareto([result], pareto), plot_ttft_cdf(result, cdf)]
