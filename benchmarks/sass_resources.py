"""What a kernel compiled for sm_90 on a machine without a GPU costs before it runs: read
from its cubin with Triton's bundled cuobjdump (``prefill_ptxas.py``, ``topk_ptxas.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton


def resources(kernel) -> dict[str, object]:
    """Registers, stack bytes and spill instructions, shared memory, the dots (wgmma or
    mma.sync, from the PTX), and the SASS instructions, barriers, shuffles and shared-memory
    operations of one program."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        )
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    fields = dict(
        item.split(":")
        for line in usage.stdout.splitlines()
        if "REG:" in line
        for item in line.split()
    )
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ptx = kernel.asm["ptx"]
    return {
        "registers": int(fields.get("REG", -1)),
        "stack_bytes": int(fields.get("STACK", -1)),
        "spills": sum(op.startswith(("LDL", "STL")) for op in ops),
        "shared_bytes": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "sass": len(ops),
        "barriers": sum(op.startswith("BAR") for op in ops),
        "shuffles": sum(op.startswith("SHFL") for op in ops),
        "shared_ops": sum(op.startswith(("LDS", "STS", "ATOMS")) for op in ops),
    }
