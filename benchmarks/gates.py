"""Issues 13 and 14's gates from one device call's records, met or not, as a markdown table
(for the call's record in results/) and as JSON.

Reads, in DIR: ``forward_gates.json`` (bench forward at the gate batches), ``decode_<1|64>_
async.json`` and ``hf_decode.json`` (bench decode next to transformers on the same
checkpoint), ``decode_256_async.json`` (step minus forward). A missing record leaves its
gates out. Decode fractions are of the HBM roofline (bench forward's); prefill fractions of
989 TFLOP/s, the H200's dense bf16 datasheet peak (issue 13's measure). Each is of the step
timed alone (``measured_s``); a record's back-to-back time (``pipelined_s``) is named beside.

Usage: python3 benchmarks/gates.py DIR [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

BF16_PEAK = 989e12  # FLOP/s


@dataclass(frozen=True)
class Gate:
    issue: int
    name: str
    value: float
    unit: str
    threshold: float | None  # None: reported only
    at_least: bool = True  # False: the value must stay at or below the threshold

    @property
    def met(self) -> bool | None:
        if self.threshold is None:
            return None
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold


# bench forward batch -> (issue, measure, threshold)
FORWARD = {
    "decode:1@4096": (14, "roofline", 0.70),
    "decode:64@4096": (14, "roofline", 0.70),
    "decode:256@4096": (14, "roofline", 0.70),
    "decode:64@65536": (14, "roofline", 0.65),
    "prefill:2048": (13, "peak", 0.40),
    "prefill:8192": (13, "peak", 0.50),
    "prefill:8192@65536": (13, "peak", None),
}
RATIOS = {1: 10.0, 64: 20.0}  # requests -> times transformers' decode step
STEP_MINUS_FORWARD_MS = 0.3  # at 256 requests


def _load(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def gates(folder: Path) -> list[Gate]:
    out: list[Gate] = []
    for record in _load(folder / "forward_gates.json") or []:
        if record.get("batch") not in FORWARD:
            continue
        issue, measure, threshold = FORWARD[record["batch"]]
        if measure == "roofline":
            value = record["fraction_of_roofline"]
        else:
            value = record["flops"] / record["measured_s"] / BF16_PEAK
        ms = 1e3 * record["measured_s"]
        # the step alone is the gate's; back to back (as the async engine runs) is reported
        alone = f"{ms:.3f} ms"
        if "pipelined_s" in record:
            alone += f"; back to back {1e3 * record['pipelined_s']:.3f} ms"
        name = f"bench forward {record['batch']} ({alone}, of {measure})"
        out.append(Gate(issue, name, value, "fraction", threshold))
    hf = {r["batch"]: r["step_ms"] for r in _load(folder / "hf_decode.json") or []}
    for requests, times in RATIOS.items():
        engine = _load(folder / f"decode_{requests}_async.json")
        if engine is None or requests not in hf:
            continue
        step = engine["median_step_ms"]
        name = f"bench decode x{requests}: {step:.2f} ms vs transformers {hf[requests]:.2f} ms"
        out.append(Gate(14, name, hf[requests] / step, "x", times))
    wide = _load(folder / "decode_256_async.json")
    if wide is not None:
        value = wide["median_step_minus_forward_ms"]
        name = "bench decode x256: step minus forward"
        out.append(Gate(14, name, value, "ms", STEP_MINUS_FORWARD_MS, at_least=False))
    return out


def table(rows: list[Gate]) -> str:
    lines = ["| issue | gate | value | needed | met |", "|---|---|---|---|---|"]
    for g in rows:
        value = f"{g.value:.1%}" if g.unit == "fraction" else f"{g.value:.3g} {g.unit}"
        if g.threshold is None:
            needed, met = "reported", ""
        else:
            bound = f"{g.threshold:.0%}" if g.unit == "fraction" else f"{g.threshold:g} {g.unit}"
            needed = (">= " if g.at_least else "<= ") + bound
            met = "yes" if g.met else "**no**"
        lines.append(f"| {g.issue} | {g.name} | {value} | {needed} | {met} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--output", type=Path, default=None, help="the gates as JSON")
    args = p.parse_args(argv)
    rows = gates(args.folder)
    if not rows:
        print(f"no gate records in {args.folder}")
        return 1
    print(table(rows))
    if args.output is not None:
        payload = [{**asdict(g), "met": g.met} for g in rows]
        args.output.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
