"""Per-op efficiency calibrated from the fast path's `bench forward` records and profiles.

A `bench forward` record (``benchmarks/results/*.json``, ``"kind": "forward"``) gives one
case's measured step time and the planner's own roofline for it (``model``, ``batch``,
``measured_s``, ``roofline_s``, ``commit``). A kernel profile of the same run
(``*-profile-TAG.json`` beside ``*-forward-*-TAG.json``: per case, the top kernels with
their summed time) splits the step among op groups::

    routed experts  moe.experts + moe.act + moe.unpermute   <- kernels moe_*
    attention       attn.core (kind attention)              <- kernels sparse_attn*
    mhc             mhc + head.hc_norm                      <- kernels prenorm_gemm*, hc_*
    rest            every other op                          <- the step minus the above

Each group's efficiency in a case is its ops' roofline time (the planner's counting for
the recorded model and batch, bf16) over its measured time. A record without a profile
takes the group split of the nearest profiled case of its phase, all groups scaled by one
factor so that its own step time is reproduced (or its whole-step efficiency for every
group, when no case of the phase is profiled). Only the newest record of each (model,
case) counts (by date, then the faster: the fast path only gets faster between dated
re-runs), and a record whose roofline the current counting no longer reproduces is
skipped (its bytes were others).

At planning time an op's efficiency is the one of the nearest calibration point of its
group and phase in (tokens, context) -- rows per expert instead of tokens for the routed
experts, which do not depend on context -- measured on log scales; the op then takes
``roofline / efficiency``. The measured H200 bf16 efficiencies are assumed to carry to
other GPUs and formats (docs/planner.md).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from rackserve.planner.opcost import ATTENTION, MOE, BatchShape, OpCost

ROUTED, ATTN, MHC, REST = "routed_experts", "attention", "mhc", "rest"
GROUPS = (ROUTED, ATTN, MHC, REST)
# Kernel names of each profiled group (the fast path's Triton kernels).
KERNELS = {
    ROUTED: re.compile(r"^moe_"),
    ATTN: re.compile(r"^sparse_attn"),
    MHC: re.compile(r"^(prenorm_gemm|hc_)"),
}
_MODEL = re.compile(r"^(\S+) \((\d+) layers, (\d+) experts\)$")
# a latency-bound op at batch 1 measures ~1% of its roofline; above 1 the counting is off
_EFFICIENCY_RANGE = (0.001, 1.0)


def op_group(op: OpCost) -> str:
    """The calibration group of a planner op."""
    if op.kind == MOE or op.name in ("moe.act", "moe.unpermute"):
        return ROUTED
    if op.kind == ATTENTION:
        return ATTN
    if op.name in ("mhc", "head.hc_norm"):
        return MHC
    return REST


def op_roofline(op: OpCost, gpu) -> float:
    """Seconds of one op at peak FLOP/s or peak HBM bandwidth, whichever binds."""
    return max(op.flops / gpu.peak_flops(op.precision), op.bytes / gpu.hbm_bw)


@dataclass(frozen=True)
class Source:
    """Where a calibration point came from."""

    file: str
    case: str
    commit: str
    profiled: bool  # the group's time was measured (a kernel profile), not split by analogy
    date: str = ""

    def describe(self) -> str:
        how = "profiled" if self.profiled else "step only"
        return f"{self.file} {self.case} @{self.commit} ({how})"


@dataclass(frozen=True)
class OpSite:
    """Where an op runs, as calibration looks it up: the step's phase, tokens on the rank,
    context per request and the routed rows each local expert sees."""

    phase: str
    num_tokens: int
    context: int
    rows_per_expert: float

    @classmethod
    def of(cls, batch: BatchShape, num_experts: int, top_k: int, ep_size: int) -> OpSite:
        phase = "decode" if batch.new_tokens <= 16 else "prefill"  # counting's logits rule
        rows = batch.num_tokens * ep_size * top_k / num_experts
        return cls(phase, batch.num_tokens, batch.context_len, rows)


@dataclass(frozen=True)
class CalibrationPoint:
    group: str
    site: OpSite
    efficiency: float  # roofline / measured, of this group in this case
    source: Source

    def distance(self, site: OpSite) -> float:
        """Log-scale distance in (tokens or rows per expert, context)."""
        if self.group == ROUTED:  # the experts' work does not depend on context
            return abs(math.log(max(site.rows_per_expert, 1e-3) / self.site.rows_per_expert))
        tokens = abs(math.log(max(site.num_tokens, 1) / max(self.site.num_tokens, 1)))
        return tokens + abs(math.log((site.context + 1) / (self.site.context + 1)))


class OpCalibration:
    """Calibration points per (group, phase); ``efficiency`` looks one up."""

    def __init__(self, points: list[CalibrationPoint], skipped: list[str] | None = None) -> None:
        self.points = points
        self.skipped = skipped or []  # records left out, with why (for --explain)

    def __bool__(self) -> bool:
        return bool(self.points)

    def lookup(self, group: str, site: OpSite) -> CalibrationPoint | None:
        """The nearest point of ``group`` in ``site``'s phase (None: no record there)."""
        candidates = [p for p in self.points if p.group == group and p.site.phase == site.phase]
        if not candidates:
            return None
        # ties (e.g. the routed experts at equal rows per expert, any context): a profiled
        # point first, then the newest record
        return min(
            candidates,
            key=lambda p: (p.distance(site), not p.source.profiled, _negated(p.source.date)),
        )

    def op_time(self, op: OpCost, gpu, site: OpSite) -> float | None:
        """Calibrated seconds of ``op`` at ``site`` (None: nothing calibrates it)."""
        point = self.lookup(op_group(op), site)
        if point is None:
            return None
        return op_roofline(op, gpu) / point.efficiency

    def explain(self, site: OpSite) -> list[str]:
        lines = [
            f"calibration at {site.phase}, {site.num_tokens} tokens/rank, context "
            f"{site.context}, {site.rows_per_expert:.1f} rows/expert:"
        ]
        for group in GROUPS:
            point = self.lookup(group, site)
            if point is None:
                lines.append(f"  {group:<15} default efficiencies (no {site.phase} record)")
            else:
                lines.append(
                    f"  {group:<15} efficiency {point.efficiency:.3f} from "
                    f"{point.source.describe()}"
                )
        lines += [f"  skipped: {why}" for why in self.skipped]
        return lines


# ---- reading the records ---------------------------------------------------------------
def _records(results_dir: Path, gpu: str) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for rec in data if isinstance(data, list) else [data]:
            if (
                isinstance(rec, dict)
                and rec.get("kind") == "forward"
                and rec.get("implementation") == "fast"
                and gpu.lower() in str(rec.get("gpu", "")).lower()
                and float(rec.get("measured_s", 0)) > 0
                and float(rec.get("roofline_s", 0)) > 0
            ):
                out.append((path.name, rec))
    return out


def _newest(records: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    best: dict[tuple[str, str], tuple[str, dict]] = {}
    for name, rec in records:
        key = (str(rec.get("model")), str(rec.get("batch")))
        rank = (str(rec.get("date", "")), -float(rec["measured_s"]))
        old = best.get(key)
        if old is None or rank > (str(old[1].get("date", "")), -float(old[1]["measured_s"])):
            best[key] = (name, rec)
    return list(best.values())


def _profile(results_dir: Path, forward_file: str, case: str) -> list[dict] | None:
    """The case's kernel list from the profile of the same run (same file tag), if any."""
    tag = Path(forward_file).stem.rsplit("-", 1)[-1]
    for path in sorted(results_dir.glob(f"*-profile-{tag}.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        entry = data.get(case) if isinstance(data, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("top"), list):
            return entry["top"]
    return None


def _case_ops(rec: dict) -> tuple[list[OpCost], OpSite] | str:
    """The planner's ops for a record's model and batch, or why they cannot be had."""
    from rackserve.bench.forward import BatchSpec  # the one grammar of --batch
    from rackserve.model.presets import preset_config
    from rackserve.planner.counting import step_ops
    from rackserve.planner.models import Formats

    m = _MODEL.match(str(rec.get("model", "")))
    if m is None:
        return f"model {rec.get('model')!r} is not 'PRESET (N layers, E experts)'"
    try:
        cfg = preset_config(m.group(1), int(m.group(2)), int(m.group(3)))
        spec = BatchSpec.parse(str(rec.get("batch")))
    except ValueError as e:
        return str(e)
    bf16 = Formats(
        weight_bytes=2, expert_bytes=2, kv_bytes=2, act_bytes=2, dispatch_bytes=2,
        gemm_precision="bf16", expert_precision="bf16", attention_precision="bf16",
        indexer_precision="bf16",
    )  # fmt: skip
    batch = BatchShape(spec.num_requests, spec.new_tokens, spec.context)
    ops = step_ops(cfg, batch, bf16, ep_size=1, logits_tokens=spec.num_requests)
    return ops, OpSite.of(batch, cfg.n_routed_experts, cfg.num_experts_per_tok, 1)


def _group_rooflines(ops: list[OpCost], gpu) -> dict[str, float]:
    out = dict.fromkeys(GROUPS, 0.0)
    for op in ops:
        out[op_group(op)] += op_roofline(op, gpu)
    return out


def load_op_calibration_points(
    results_dir: str | Path,
    gpu_name: str = "H200",
    exclude: tuple[str, str] | None = None,
) -> OpCalibration:
    """Every group's calibration points from the fast-path forward records of ``gpu_name``;
    ``exclude`` (file, case) leaves one record out (to predict it from the others)."""
    from rackserve.planner.hardware import get_hardware

    gpu = get_hardware(gpu_name.lower())
    results = Path(results_dir)
    cases = []
    skipped: list[str] = []
    for name, rec in _newest(_records(results, gpu_name)):
        if exclude is not None and (name, str(rec.get("batch"))) == exclude:
            continue
        built = _case_ops(rec)
        case = str(rec.get("batch"))
        if isinstance(built, str):
            skipped.append(f"{name} {case}: {built}")
            continue
        ops, site = built
        roofline = _group_rooflines(ops, gpu)
        total = sum(roofline.values())
        if abs(total / float(rec["roofline_s"]) - 1) > 1e-3:
            skipped.append(
                f"{name} {case}: recorded roofline {rec['roofline_s']:.3g} s, the counting now "
                f"gives {total:.3g} s (the record's bytes were others)"
            )
            continue
        cases.append((name, rec, site, roofline, _profile(results, name, case)))
    points: list[CalibrationPoint] = []
    profiled = [c for c in cases if c[4] is not None]
    for name, rec, site, roofline, kernels in cases:
        measured = float(rec["measured_s"])
        commit = str(rec.get("commit", "?"))
        step_eff = sum(roofline.values()) / measured
        if kernels is not None:
            efficiencies = _profiled_split(roofline, kernels, measured)
            source = Source(name, str(rec["batch"]), commit, True, str(rec.get("date", "")))
        else:
            # the group split of the nearest profiled case of this phase, at this level
            same_phase = [c for c in profiled if c[2].phase == site.phase]
            if same_phase:
                near = min(same_phase, key=lambda c: _site_distance(c[2], site))
                split = _profiled_split(near[3], near[4], float(near[1]["measured_s"]))
                # one scale for every group, so this case's own step time is reproduced
                at_split = sum(roofline[g] / split[g] for g in split if roofline[g] > 0)
                efficiencies = {g: e * at_split / measured for g, e in split.items()}
            else:
                efficiencies = dict.fromkeys(GROUPS, step_eff)
            source = Source(name, str(rec["batch"]), commit, False, str(rec.get("date", "")))
        for group, eff in efficiencies.items():
            if roofline[group] > 0:
                points.append(CalibrationPoint(group, site, _clip(eff), source))
    return OpCalibration(points, skipped)


def recorded_cases(results_dir: str | Path, gpu_name: str = "H200") -> list[tuple[str, dict]]:
    """The (file, record) pairs calibration uses: the newest fast-path record per case."""
    return _newest(_records(Path(results_dir), gpu_name))


def predict_case(rec: dict, calibration: OpCalibration | None, gpu_name: str = "H200") -> float:
    """The planner's step time for a recorded case (its model and batch, bf16, one GPU):
    calibrated ops at their efficiency, the others at the default factors + launches."""
    from rackserve.planner.cost import Efficiency, op_time
    from rackserve.planner.hardware import get_hardware

    built = _case_ops(rec)
    if isinstance(built, str):
        raise ValueError(built)
    ops, site = built
    gpu, eff = get_hardware(gpu_name.lower()), Efficiency(ops=calibration)
    return sum(op_time(op, gpu, eff, site) for op in ops)


def _profiled_split(roofline: dict[str, float], kernels: list[dict], measured: float) -> dict:
    """Group efficiencies of a profiled case: kernel time per group, the rest of the step
    (kernels outside the groups, launch gaps) for ``rest``."""
    spent = dict.fromkeys(KERNELS, 0.0)
    for kernel in kernels:
        for group, pattern in KERNELS.items():
            if pattern.match(str(kernel.get("name", ""))):
                spent[group] += float(kernel.get("us", 0.0)) * 1e-6
                break
    # a group none of whose kernels made the profile's top list is timed with the rest
    unlisted = [g for g, t in spent.items() if t == 0]
    rest_roofline = roofline[REST] + sum(roofline[g] for g in unlisted)
    rest_time = measured - sum(spent.values())
    out = {g: roofline[g] / t for g, t in spent.items() if t > 0}
    if rest_time > 0:
        for g in [REST, *unlisted]:
            out[g] = rest_roofline / rest_time
    return out


def _site_distance(a: OpSite, b: OpSite) -> float:
    return abs(math.log(max(a.num_tokens, 1) / max(b.num_tokens, 1))) + abs(
        math.log((a.context + 1) / (b.context + 1))
    )


def _negated(date: str) -> tuple[int, ...]:
    """A sort key that puts later ISO dates first."""
    return tuple(-ord(c) for c in date)


def _clip(eff: float) -> float:
    return min(max(eff, _EFFICIENCY_RANGE[0]), _EFFICIENCY_RANGE[1])
