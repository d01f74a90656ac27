"""What every kernel microbenchmark (``*_bench.py``) times and stamps its records with, and
the bench model and its eager step that the forward probes (``graph_gap.py``,
``profile_forward.py``, ``host_probe.py``, ``prefill_graph_probe.py``, ``ncu_step.py``) run."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import triton.testing

from rackserve.bench.forward import BatchSpec, SyntheticStep, synthetic_step
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.step_buffers import StepBuffers


def time_us(fn: Callable[[], object]) -> tuple[float, float | None]:
    """(do_bench median, do_bench_cudagraph median) in microseconds: L2 flushed and launch
    included, then inside a CUDA graph (what decode sees); None for an op that cannot be
    captured (a reference that syncs)."""
    plain = triton.testing.do_bench(fn, return_mode="median") * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    except Exception:
        graph = None
    return plain, graph


def stamped(records: list[dict], device: torch.device) -> list[dict]:
    """``records`` with the GPU's name and today's date."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat()}
    return [r | meta for r in records]


def events_ms(fn: Callable[[], object], iters: int = 30) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` between two CUDA events."""
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def host_ms(fn: Callable[[], object], iters: int = 30) -> list[float]:
    """Milliseconds of host time of each of ``iters`` calls of ``fn``, the GPU idle at each
    start: how long the host takes to issue the work (no sync inside ``fn``)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return out


def bench_model(layers: int = 4, experts: int = 64) -> DeepseekV4ForCausalLM:
    """The v4-flash preset with ``layers`` layers and ``experts`` experts, random bf16
    weights (seed 0) on the GPU, as ``rackserve bench forward`` builds it."""
    cfg = preset_config("v4-flash", layers, experts)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    return model.eval()


def eager_step(
    model: DeepseekV4ForCausalLM, batch: str
) -> tuple[Callable[[], None], SyntheticStep]:
    """(run, step): ``run()`` is one eager forward + logits of ``batch`` (e.g.
    "prefill:2048") through the runner's device path, its metadata built once beforehand."""
    s = synthetic_step(model, BatchSpec.parse(batch))
    device = next(model.parameters()).device
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, device)
    input_ids, meta, logits_indices = buffers.eager_step(s.step.inputs, s.step.table_writes)

    def run() -> None:
        hidden, _ = model(input_ids, meta, s.caches)
        model.compute_logits(hidden[logits_indices])

    return run, s
