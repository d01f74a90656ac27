"""The engine's decode step against transformers' on the same checkpoint, from one device
call's records: ``decode_<name>.json`` (bench decode) and ``hf_decode.json``
(hf_decode.py) in DIR. Usage: python3 benchmarks/hf_ratio.py DIR NAME [NAME ...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    out, names = Path(argv[0]), argv[1:]
    try:
        hf = {r["batch"]: r["step_ms"] for r in json.loads((out / "hf_decode.json").read_text())}
    except (OSError, ValueError, KeyError) as e:
        print(f"no transformers comparison: {e}")
        return 1
    for name in names:
        try:
            record = json.loads((out / f"decode_{name}.json").read_text())
        except (OSError, ValueError) as e:
            print(f"decode_{name}: no engine record ({e})")
            continue
        c, step = record["concurrency"], record["median_step_ms"]
        if c not in hf:
            print(f"decode_{name}: transformers did not run {c} requests")
            continue
        print(f"decode_{name} @{record.get('context', '?')}: engine step {step:.2f} ms, "
              f"transformers {hf[c]:.2f} ms -> {hf[c] / step:.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
