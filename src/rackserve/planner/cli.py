"""`rackserve plan`: search P/D + DEP configurations for a model, GPU and workload.

Prints the Pareto frontier (throughput per GPU against P90 tok/s per user), writes
``plan.json`` and ``plan.png`` to ``--output-dir``, and with ``--explain CONFIG`` prints one
configuration's step-time breakdown.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from rackserve.planner.calibration import load_op_calibration_points
from rackserve.planner.cost import (
    Efficiency,
    load_calibration,
    load_op_calibration,
    op_time,
    roofline_time,
)
from rackserve.planner.counting import BatchShape, step_ops
from rackserve.planner.hardware import get_hardware, hardware_presets
from rackserve.planner.models import PlannerModel, load_model, model_presets
from rackserve.planner.search import SystemConfig, SystemResult, evaluate, pareto, search
from rackserve.planner.simulate import StepBreakdown, Workload

# Agentic defaults: long multi-turn contexts with the ~95% prefix-cache hits MISSION.md
# describes; fixed defaults: an 8K/1K benchmark.
AGENTIC = {"input_len": 60000, "output_len": 600, "cached_frac": 0.95, "turns": 20}
FIXED = {"input_len": 8192, "output_len": 1024, "cached_frac": 0.0, "turns": 1}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="plan a rack deployment (P/D ratio, DEP sizes)")
    p.add_argument(
        "--model",
        default="deepseek-v4-flash",
        help=f"preset ({', '.join(model_presets())}) or HF config dir / config.json",
    )
    p.add_argument("--hardware", default="gb300-nvl72", choices=sorted(hardware_presets()))
    p.add_argument("--workload", default="agentic", choices=("agentic", "fixed"))
    p.add_argument("--input-len", type=int, help="mean prompt tokens per request/turn")
    p.add_argument("--output-len", type=int, help="mean output tokens per request/turn")
    p.add_argument("--cached-frac", type=float, help="fraction of prompt tokens hit in cache")
    p.add_argument("--turns", type=int, help="turns per agent session (informational)")
    p.add_argument("--slo-tok-s", type=float, default=50.0, help="min P90 tok/s per user")
    p.add_argument("--gpu-hour-usd", type=float, default=3.0, help="price of one GPU-hour")
    p.add_argument("--max-gpus", type=int, help="GPUs available (default: one NVLink domain)")
    p.add_argument(
        "--results-dir",
        default="benchmarks/results",
        help="measured forward results used to calibrate efficiencies",
    )
    p.add_argument(
        "--explain",
        metavar="CONFIG",
        help="step breakdown of e.g. 3xDEP2+1xDEP16-t16384-b64-s2 (names as printed in the table)",
    )
    p.add_argument("--output-dir", default="plan_out", help="where plan.json / plan.png go")
    p.add_argument("--top", type=int, default=15, help="frontier rows to print")
    p.set_defaults(func=run)


def build_workload(args: argparse.Namespace) -> Workload:
    base = AGENTIC if args.workload == "agentic" else FIXED
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    agentic = args.workload == "agentic"
    # Agentic turns vary in length and arrive independently on each DP rank.
    return Workload(
        **values, length_cv=1.0 if agentic else 0.0, step_load_cv=0.2 if agentic else 0.0
    )


def calibrated(model: PlannerModel, gpu_name: str, results_dir: str) -> dict[str, Efficiency]:
    """Efficiency per phase: op factors measured on the H200 (``load_op_calibration``), then
    the per-op efficiencies of the fast path's forward records (``planner/calibration.py``)
    where there are any; without them, the older whole-phase scaling of the kind factors
    by forward records (``load_calibration``)."""
    h200, base = get_hardware("h200"), load_op_calibration(results_dir)
    ops = load_op_calibration_points(results_dir, "H200")
    if ops:
        with_ops = replace(base, ops=ops)
        return {"prefill": with_ops, "decode": with_ops}
    out = {}
    for phase, batch in (("prefill", BatchShape(2, 8192, 0)), ("decode", BatchShape(64, 1, 8192))):
        step = step_ops(model.cfg, batch, model.formats)
        modelled = sum(op_time(op, h200, base) for op in step)
        out[phase] = load_calibration(
            results_dir, phase, roofline_time(step, h200) / modelled, gpu="H200", base=base
        )
    return out


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    gpu = get_hardware(args.hardware)
    workload = build_workload(args)
    eff = calibrated(model, gpu.name, args.results_dir)["decode"]
    max_gpus = args.max_gpus or max(gpu.nvlink_domain, 8)
    if args.explain:
        result = evaluate(
            model, gpu, workload, SystemConfig.parse(args.explain), eff, args.gpu_hour_usd
        )
        print(explain(result))
        print(explain_calibration(model, result, eff))
        return 0
    results = search(model, gpu, workload, eff, args.gpu_hour_usd, max_gpus)
    if not results:
        raise ValueError(f"no configuration of {model.name} fits on {max_gpus} x {gpu.name}")
    frontier = pareto(results)
    print(
        f"{model.name} on {gpu.name} (<= {max_gpus} GPUs), workload {args.workload}: "
        f"{asdict(workload)}"
    )
    print(table(frontier[-args.top :][::-1], args.slo_tok_s))
    meeting = [r for r in frontier if r.p90_tok_s_per_user >= args.slo_tok_s]
    if meeting:
        best = max(meeting, key=lambda r: r.tok_s_per_gpu)
        print(
            f"\nbest at >= {args.slo_tok_s:g} tok/s/user: {best.config.name} "
            f"({best.tok_s_per_gpu:,.0f} tok/s/GPU, ${best.usd_per_mtok:.4f}/Mtok)"
        )
    else:
        print(f"\nno configuration reaches {args.slo_tok_s:g} tok/s per user")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "plan.json", args, workload, frontier)
    write_png(out / "plan.png", results, frontier, args.slo_tok_s, f"{model.name} on {gpu.name}")
    print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")
    return 0


def _row(r: SystemResult) -> dict:
    return {
        "config": r.config.name,
        "gpus": r.config.num_gpus,
        "tok_s_per_gpu": r.tok_s_per_gpu,
        "output_tok_s_per_gpu": r.output_tok_s_per_gpu,
        "p90_tok_s_per_user": r.p90_tok_s_per_user,
        "ttft_s": r.ttft_s,
        "usd_per_mtok": r.usd_per_mtok,
        "bound": r.bound,
    }


def table(rows: list[SystemResult], slo: float) -> str:
    head = (
        f"{'configuration':<34} {'GPUs':>4} {'tok/s/GPU':>10} {'out/s/GPU':>9} "
        f"{'P90 tok/s/u':>11} {'TTFT s':>7} {'$/Mtok':>8} {'bound':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = " " if r.p90_tok_s_per_user >= slo else "*"
        lines.append(
            f"{r.config.name:<34} {r.config.num_gpus:>4} {r.tok_s_per_gpu:>10,.0f} "
            f"{r.output_tok_s_per_gpu:>9,.0f} {r.p90_tok_s_per_user:>10.1f}{mark} "
            f"{r.ttft_s:>7.2f} {r.usd_per_mtok:>8.4f} {r.bound:>8}"
        )
    lines.append("(* below the SLO)")
    return "\n".join(lines)


def _breakdown(title: str, step: StepBreakdown) -> list[str]:
    lines = [
        f"{title}: step {step.total_s * 1e3:.2f} ms = compute {step.compute_s * 1e3:.2f} "
        f"(+) all-to-all {step.all_to_all_s * 1e3:.2f} + CPU {step.cpu_s * 1e3:.2f} ms; "
        f"DP imbalance x{step.dp_imbalance:.3f}, EP balancedness {step.ep_balancedness:.3f}"
    ]
    total = sum(t for _, t in step.op_times) or 1.0
    for name, t in sorted(step.op_times, key=lambda x: -x[1])[:12]:
        lines.append(f"  {name:<20} {t * 1e3:9.3f} ms {100 * t / total:5.1f}%")
    return lines


def explain(r: SystemResult) -> str:
    lines = [
        f"{r.config.name}: {r.config.num_gpus} GPUs, {r.tok_s_per_gpu:,.0f} tok/s/GPU, "
        f"P90 {r.p90_tok_s_per_user:.1f} tok/s/user, TTFT {r.ttft_s:.2f} s, "
        f"${r.usd_per_mtok:.4f}/Mtok, bound by {r.bound}"
    ]
    lines += _breakdown(
        f"prefill DEP{r.prefill.dep} ({r.prefill.tokens_per_rank} tok/rank)", r.prefill.step
    )
    lines += _breakdown(
        f"decode DEP{r.decode.dep} (batch {r.decode.batch_per_rank}/rank, "
        f"draft {r.decode.draft_depth}, {r.decode.accepted_per_step:.2f} "
        f"tok/step)",
        r.decode.step,
    )
    return "\n".join(lines)


def explain_calibration(model: PlannerModel, r: SystemResult, eff: Efficiency) -> str:
    """Which measured records calibrated each op group at this configuration's prefill and
    decode steps, and the efficiency each gives."""
    if eff.ops is None:
        return "calibration: none (no fast-path forward records): the default efficiencies"
    lines = []
    for step in (r.prefill.step, r.decode.step):
        if step.site is not None:
            lines += eff.ops.explain(step.site)
    return "\n".join(lines)


def write_json(
    path: Path, args: argparse.Namespace, workload: Workload, frontier: list[SystemResult]
) -> None:
    data = {
        "model": args.model,
        "hardware": args.hardware,
        "workload": asdict(workload),
        "slo_tok_s": args.slo_tok_s,
        "gpu_hour_usd": args.gpu_hour_usd,
        "frontier": [_row(r) for r in frontier],
    }
    path.write_text(json.dumps(data, indent=2))


def write_png(
    path: Path, results: list[SystemResult], frontier: list[SystemResult], slo: float, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(
        [r.p90_tok_s_per_user for r in results],
        [r.tok_s_per_gpu for r in results],
        s=6,
        alpha=0.25,
        label="configurations",
    )
    ax.plot(
        [r.p90_tok_s_per_user for r in frontier],
        [r.tok_s_per_gpu for r in frontier],
        "o-",
        color="C3",
        label="Pareto frontier",
    )
    ax.axvline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} tok/s/user")
    ax.set_xlabel("P90 interactivity (tok/s per user)")
    ax.set_ylabel("throughput per GPU (tok/s, cached + uncached + output)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
