"""Roofline cost of ops with per-kind efficiency factors, and calibration from measurements.

An op takes ``max(flops / (peak * eff_compute[kind]), bytes / (hbm_bw * eff_hbm))`` plus a
fixed launch cost per kernel. The efficiency constants below are the whole calibration of
the model; they are the same for every GPU, model and validation test (docs/planner.md
explains each value). Measured results in ``benchmarks/results/*.json`` scale them (see
``load_calibration``); without such files the defaults hold.

Calibration file schema (one JSON object per file, or a list of them)::

    {"kind": "forward", "gpu": "H200", "phase": "prefill" | "decode",
     "measured_s": 0.0123,   # GPU time of the forward (bench forward)
     "roofline_s": 0.0081,   # this module's pure roofline for the same batch (eff = 1)
     "batch": {...}, "model": "...", "date": "...", "commit": "..."}   # informational

For each phase the median of ``roofline_s / measured_s`` over matching records is the
measured overall efficiency; the ratio of it to the default model's overall efficiency
scales every factor of that phase, clipped so no factor leaves its plausible range.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rackserve.planner.counting import ATTENTION, GEMM, INDEXER, MEMORY, MOE, OpCost
from rackserve.planner.hardware import GpuSpec

if TYPE_CHECKING:
    from rackserve.planner.calibration import OpCalibration, OpSite


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peak reached in practice (dimensionless) and fixed costs (s).

    Literature values for tuned H100/H800-class serving kernels, not fits to single
    validation targets (docs/planner.md gives the reasoning for each):
    - gemm 0.6: DeepGEMM peaks at ~0.75 of dense FP8 on large shapes; serving shapes
      (K = 1536 / 512, N = 576) and the FP8 activation quantisation around them cost more.
    - moe 0.45: grouped GEMMs with ragged groups padded to 128-row blocks.
    - attention 0.5: FlashMLA decode reaches 0.6-0.67 of BF16 peak at best; causal
      prefill attention with head dims 192 / 128 stays near 0.5.
    - hbm 0.8: streaming kernels; nvlink 0.75 / nic 0.9: DeepEP's ~150 of 200 GB/s NVLink
      and ~45 of 50 GB/s RDMA.
    - overlap 0.4: two-batch overlap hides 40% of the shorter of compute and all-to-all
      (the comm kernels take SMs from the GEMMs); with compute ~ all-to-all this gives
      the +25% that SGLang reports for TBO (27-35%).
    """

    gemm: float = 0.6
    moe: float = 0.45
    attention: float = 0.5
    indexer: float = 0.5
    memory: float = 0.5  # compute side of elementwise ops (their bytes dominate anyway)
    hbm: float = 0.8
    nvlink: float = 0.75
    nic: float = 0.9
    kernel_launch_s: float = 2e-6  # per kernel under CUDA graphs
    overlap: float = 0.4  # fraction of the shorter of compute / all-to-all hidden by TBO
    cpu_step_s: float = 2e-3  # scheduling + input prep + DP sync per engine step
    # per-op efficiencies measured by the fast path (planner/calibration.py); where one
    # applies it replaces the kind factors above and the launch cost (both measured)
    ops: OpCalibration | None = field(default=None, compare=False, repr=False)

    def compute(self, kind: str) -> float:
        return {
            GEMM: self.gemm,
            MOE: self.moe,
            ATTENTION: self.attention,
            INDEXER: self.indexer,
            MEMORY: self.memory,
        }[kind]


# Plausible ranges a calibrated factor is clipped to (compute, bandwidth).
_COMPUTE_RANGE = (0.2, 0.85)
_BANDWIDTH_RANGE = (0.4, 0.95)


def op_time(op: OpCost, gpu: GpuSpec, eff: Efficiency, site: OpSite | None = None) -> float:
    """Seconds for one op on one GPU (roofline with efficiencies, plus launches); at a
    ``site`` that ``eff.ops`` calibrates, roofline / the measured efficiency there."""
    if eff.ops is not None and site is not None:
        calibrated = eff.ops.op_time(op, gpu, site)
        if calibrated is not None:
            return calibrated
    t_flops = op.flops / (gpu.peak_flops(op.precision) * eff.compute(op.kind))
    t_bytes = op.bytes / (gpu.hbm_bw * eff.hbm)
    return max(t_flops, t_bytes) + op.launches * eff.kernel_launch_s


def roofline_time(ops: list[OpCost], gpu: GpuSpec) -> float:
    """Pure roofline (efficiency 1, no launches): the ``roofline_s`` of calibration files."""
    return sum(max(op.flops / gpu.peak_flops(op.precision), op.bytes / gpu.hbm_bw) for op in ops)


def scale_efficiency(eff: Efficiency, factor: float) -> Efficiency:
    """Every compute and HBM factor times ``factor``, clipped to its plausible range."""
    updates = {}
    for f in fields(Efficiency):
        if f.name in ("gemm", "moe", "attention", "indexer", "memory"):
            updates[f.name] = min(
                max(getattr(eff, f.name) * factor, _COMPUTE_RANGE[0]), _COMPUTE_RANGE[1]
            )
        elif f.name == "hbm":
            updates[f.name] = min(max(eff.hbm * factor, _BANDWIDTH_RANGE[0]), _BANDWIDTH_RANGE[1])
    return replace(eff, **updates)


def read_results(results_dir: str | Path) -> list[dict]:
    """All forward-measurement records under ``results_dir`` (schema above); others skipped."""
    records: list[dict] = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for rec in data if isinstance(data, list) else [data]:
            if (
                isinstance(rec, dict)
                and rec.get("kind") == "forward"
                # our plain-torch reference path measures Python loops, not the kernels
                # this model describes: it must not drag the factors down
                and rec.get("implementation") != "reference"
                and float(rec.get("measured_s", 0)) > 0
                and float(rec.get("roofline_s", 0)) > 0
            ):
                records.append(rec)
    return records


def load_op_calibration(
    results_dir: str | Path, gpu: str = "H200", base: Efficiency | None = None
) -> Efficiency:
    """``base`` with ``gemm`` and ``hbm`` set from measured op records (benchmarks/h200_ops.py).

    Records: ``{"kind": "op_efficiency", "op_kind": "gemm" | "moe" | "hbm", "shape",
    "efficiency", "gpu"}``. gemm = median efficiency of the compute-bound projections
    (at least 4096 tokens); hbm = median of the bandwidth-bound records (a device copy and
    expert weight streaming at decode token counts). Both clipped to the plausible ranges.
    """
    eff = base or Efficiency()
    recs = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        recs += [
            r
            for r in (data if isinstance(data, list) else [data])
            if isinstance(r, dict)
            and r.get("kind") == "op_efficiency"
            and gpu.lower() in str(r.get("gpu", "")).lower()
        ]
    gemm = [
        r["efficiency"]
        for r in recs
        if r["op_kind"] == "gemm" and int(str(r["shape"]).split()[0].removeprefix("T=")) >= 4096
    ]
    hbm = [r["efficiency"] for r in recs if r["op_kind"] in ("hbm", "moe")]
    updates = {}
    if gemm:
        updates["gemm"] = min(max(statistics.median(gemm), _COMPUTE_RANGE[0]), _COMPUTE_RANGE[1])
    if hbm:
        updates["hbm"] = min(max(statistics.median(hbm), _BANDWIDTH_RANGE[0]), _BANDWIDTH_RANGE[1])
    return replace(eff, **updates)


def load_calibration(
    results_dir: str | Path,
    phase: str,
    default_overall: float,
    gpu: str | None = None,
    base: Efficiency | None = None,
) -> Efficiency:
    """Efficiency for ``phase`` scaled by measured results, or ``base`` if none match.

    ``default_overall`` is roofline / modelled time of the default model for a typical batch
    of that phase; the scale is measured_overall / default_overall.
    """
    eff = base or Efficiency()
    recs = [
        r
        for r in read_results(results_dir)
        if r.get("phase") == phase and (gpu is None or str(r.get("gpu", "")).lower() == gpu.lower())
    ]
    if not recs or default_overall <= 0:
        return eff
    measured = statistics.median(float(r["roofline_s"]) / float(r["measured_s"]) for r in recs)
    return scale_efficiency(eff, measured / default_overall)
