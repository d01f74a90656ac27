"""benchmarks/gates.py: issues 13 and 14's gates read from a device call's records, here
session 28's call 4 on an H200 (benchmarks/results), whose note reported them by hand."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gates  # noqa: E402

CALL = "2026-12-06-h200-s28-call4-d428161-"
RECORDS = ("forward_gates", "decode_1_async", "decode_64_async", "decode_256_async", "hf_decode")


def _call(tmp_path: Path, records: tuple[str, ...] = RECORDS) -> Path:
    results = ROOT / "benchmarks" / "results"
    for name in records:
        shutil.copy(results / f"{CALL}{name}.json", tmp_path / f"{name}.json")
    return tmp_path


def test_session_28_call_4(tmp_path: Path, capsys) -> None:
    out = tmp_path / "gates.json"
    assert gates.main([str(_call(tmp_path)), "--output", str(out)]) == 0
    rows = {g["name"].split(" (")[0]: g for g in json.loads(out.read_text())}
    assert len(rows) == 10
    met = [g["met"] for g in rows.values()]  # 5 met, 4 not (decode:256 at 68.7%), 1 reported
    assert (met.count(True), met.count(False), met.count(None)) == (5, 4, 1)
    assert abs(rows["bench forward decode:1@4096"]["value"] - 0.5466) < 1e-4
    assert abs(rows["bench forward prefill:8192"]["value"] - 0.4559) < 1e-4
    assert rows["bench forward prefill:8192@65536"]["met"] is None
    ratio = next(g for name, g in rows.items() if name.startswith("bench decode x64"))
    assert abs(ratio["value"] - 72.137 / 4.2365) < 1e-2 and ratio["met"] is False
    table = capsys.readouterr().out
    row = "| 13 | bench forward prefill:8192 (45.432 ms, of peak) | 45.6% | >= 50% | **no** |"
    assert row in table
    assert "| 14 | bench decode x256: step minus forward |" in table


def test_missing_records_leave_their_gates_out(tmp_path: Path, capsys) -> None:
    folder = _call(tmp_path, ("decode_64_async",))  # no transformers record: no ratio
    assert gates.main([str(folder)]) == 1
    assert "no gate records" in capsys.readouterr().out
    (folder / "forward_gates.json").write_text("not json")
    assert gates.gates(folder) == []


def test_back_to_back_time_is_named_beside_the_gate(tmp_path: Path) -> None:
    """A record with bench forward's back-to-back time: the gate's value is still the step
    timed alone; the back-to-back time is named in the row."""
    folder = _call(tmp_path, ("forward_gates",))
    records = json.loads((folder / "forward_gates.json").read_text())
    for r in records:
        r["pipelined_s"] = 0.9 * r["measured_s"]
    (folder / "forward_gates.json").write_text(json.dumps(records))
    rows = {g.name.split(" (")[0]: g for g in gates.gates(folder)}
    decode = rows["bench forward decode:1@4096"]
    assert abs(decode.value - 0.5466) < 1e-4
    assert "(1.294 ms; back to back 1.165 ms, of roofline)" in decode.name
