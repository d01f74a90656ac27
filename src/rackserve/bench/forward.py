"""`bench forward`: the model forward alone, for an exact synthetic batch, through the real
runner path (persistent batch -> flat inputs -> model over paged caches).

Caches are "pre-filled" synthetically: every request gets block tables covering its
context (sliding groups only their window), nothing is computed before the timed step.
Bytes and FLOPs come from ``rackserve.planner.counting`` (the planner's own counting), so
the printed fraction of roofline is directly the planner's calibration input.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rackserve.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from rackserve.kv.spec import CacheGroupSpec, cache_groups_for
from rackserve.model.batch import KVCacheTensors
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.planner.cost import roofline_time
from rackserve.planner.counting import BatchShape, step_ops
from rackserve.planner.hardware import get_hardware
from rackserve.planner.models import Formats
from rackserve.planner.opcost import OpCost
from rackserve.request import SamplingParams
from rackserve.runner.cuda_graph import (
    PREFILL_GRAPH_TOKENS,
    DecodeGraphs,
    PrefillGraphs,
    graph_serves,
)
from rackserve.runner.input_batch import InputBatch, PreparedStep
from rackserve.runner.inputs import ring_widths
from rackserve.runner.step_buffers import StepBuffers

_BATCH = re.compile(r"^(prefill|decode):(\d+)(?:@(\d+))?(?:x(\d+))?$")
_MIXED = re.compile(r"^mixed:(\d+)(?:@(\d+))?\+(\d+)@(\d+)$")
_FORMS = (
    "prefill:TOKENS[@CONTEXT], decode:REQS@CONTEXT[xTOKENS] or mixed:TOKENS[@CONTEXT]+REQS@CONTEXT"
)


@dataclass(frozen=True)
class BatchSpec:
    """``prefill:TOKENS[@CONTEXT]`` (one request), ``decode:REQS@CONTEXT[xTOKENS]``, or
    ``mixed:TOKENS[@CONTEXT]+REQS@CONTEXT``: one prefill chunk of TOKENS after CONTEXT
    cached tokens and REQS one-token decodes at their CONTEXT, in one step (eager)."""

    phase: str
    num_requests: int
    new_tokens: int
    context: int
    decode_requests: int = 0  # mixed only: the decodes riding along
    decode_context: int = 0

    @classmethod
    def parse(cls, text: str) -> BatchSpec:
        mixed = _MIXED.match(text.strip())
        if mixed:
            tokens, context, reqs, decode_context = mixed.groups()
            return cls("mixed", 1, int(tokens), int(context or 0), int(reqs), int(decode_context))
        m = _BATCH.match(text.strip())
        if not m:
            raise ValueError(f"bad --batch {text!r}: use {_FORMS}")
        phase, a, b, c = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if phase == "prefill":
            if c is not None:
                raise ValueError("prefill batches take no xTOKENS suffix")
            return cls("prefill", 1, a, int(b or 0))
        if b is None:
            raise ValueError("decode batches need a context: decode:REQS@CONTEXT")
        return cls("decode", a, int(c or 1), int(b))

    def requests(self) -> list[tuple[int, int]]:
        """(new tokens, cached context) of every request of the step, in step order."""
        main = [(self.new_tokens, self.context)] * self.num_requests
        return main + [(1, self.decode_context)] * self.decode_requests


@dataclass
class SyntheticStep:
    step: PreparedStep
    input_batch: InputBatch
    caches: KVCacheTensors
    groups: list[CacheGroupSpec]


def synthetic_step(
    model: DeepseekV4ForCausalLM,
    batch: BatchSpec,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> SyntheticStep:
    """Block tables and inputs for ``batch``; the caches hold whatever they were born with
    (``kv_dtype``: the KV groups' storage, e.g. float8 e4m3; None: the model dtype)."""
    cfg = model.cfg
    device = next(model.parameters()).device
    dtype = model.head.weight.dtype
    groups = cache_groups_for(cfg, dtype_bytes=torch.tensor([], dtype=dtype).element_size())
    shapes = batch.requests()
    next_id = {g.name: 1 for g in groups}  # block 0 is the null block
    tables: list[tuple[list[int], ...]] = []
    for new_tokens, context in shapes:
        per_group = []
        for g in groups:
            num = -(-(context + new_tokens) // g.block_tokens)
            # sliding groups: only the window rows are ever read (the manager's rule)
            first_live = g.first_live_slot(context) if g.window is not None else 0
            ids = [0] * first_live + list(
                range(next_id[g.name], next_id[g.name] + num - first_live)
            )
            next_id[g.name] += num - first_live
            per_group.append(ids)
        tables.append(tuple(per_group))
    caches = KVCacheTensors(groups, next_id, dtype, device, kv_dtype)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=1)
    new_reqs = [
        NewRequestData(
            f"r{i}",
            torch.randint(0, cfg.vocab_size, (context + new_tokens,), generator=gen).tolist(),
            context + new_tokens,
            params,
            tables[i],
            context,
        )
        for i, (new_tokens, context) in enumerate(shapes)
    ]
    sched = SchedulerOutput(
        new_reqs=new_reqs,
        cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r.req_id: n for r, (n, _) in zip(new_reqs, shapes, strict=True)},
        total_num_scheduled_tokens=sum(n for n, _ in shapes),
    )
    input_batch = InputBatch(
        {g.name: g.block_tokens for g in groups},
        len(shapes),
        max(n + c for n, c in shapes),
        cfg.vocab_size,
        cfg.eos_token_id,
        device,
        # sliding groups as rings, as the runner builds them (its step bound: this step)
        ring_widths=ring_widths(groups, max(n for n, _ in shapes)),
    )
    step = input_batch.prepare(sched)
    assert step is not None
    return SyntheticStep(step, input_batch, caches, groups)


@torch.inference_mode()
def time_forward(
    model: DeepseekV4ForCausalLM,
    synthetic: SyntheticStep,
    iters: int = 10,
    warmup: int = 2,
    graph: bool = False,
) -> list[float]:
    """Seconds per forward (+ logits of the sampled rows), each step alone: CUDA events on
    a GPU around a step issued to an idle device (see ``forward_step``)."""
    run = forward_step(model, synthetic, graph, warmup)
    return isolated_times(run, iters, next(model.parameters()).device)


def forward_step(
    model: DeepseekV4ForCausalLM, synthetic: SyntheticStep, graph: bool = False, warmup: int = 0
) -> Callable[[], None]:
    """One forward (+ logits of the sampled rows) of ``synthetic`` as a callable, its inputs
    through the runner's device path (one upload, device block tables), called ``warmup``
    times before it is returned; ``graph``: the step is captured once and replayed, as the
    runner does (``graph_serves``: a uniform decode in ``DecodeGraphs``, a prefill / mixed
    step of up to 2048 tokens in ``PrefillGraphs`` at the next captured size, its sampled
    rows' logits eagerly)."""
    run = _step_callable(model, synthetic, graph)
    for _ in range(warmup):
        run()
    return run


@torch.inference_mode()
def _step_callable(
    model: DeepseekV4ForCausalLM, synthetic: SyntheticStep, graph: bool
) -> Callable[[], None]:
    """``forward_step`` before its warm-up."""
    inputs, caches = synthetic.step.inputs, synthetic.caches
    device = next(model.parameters()).device
    num_reqs = len(inputs.rows)
    buffers = StepBuffers(synthetic.groups, synthetic.input_batch.block_tables, device)
    writes = synthetic.step.table_writes
    if not graph:
        input_ids, meta, logits_indices = buffers.eager_step(inputs, writes)

        @torch.inference_mode()
        def run_eager() -> None:  # as the runner: the hyper head on the sampled rows only
            hidden, _ = model(input_ids, meta, caches, head_rows=logits_indices)
            model.compute_logits(hidden)

        return run_eager
    if not (device.type == "cuda" and graph_serves(inputs)):
        raise ValueError(
            "CUDA graphs time uniform decode batches and steps of up to "
            f"{PREFILL_GRAPH_TOKENS[-1]} tokens on a CUDA device only"
        )
    bucket = [inputs.max_seq_len]
    if inputs.is_uniform_decode:
        graphs = DecodeGraphs(model, caches, buffers, synthetic.groups, [num_reqs], bucket)
    else:
        size = next(t for t in PREFILL_GRAPH_TOKENS if t >= len(inputs.input_ids))
        # the hyper head on the step's sampled rows (the runner's graphs run it on
        # max_num_reqs rows, padded: a few us more at 2048 tokens)
        graphs = PrefillGraphs(
            model, caches, buffers, synthetic.groups, [size], bucket, max_sampled_rows=num_reqs
        )
    buffers.apply_writes(*buffers.upload(list(writes)))
    graphs.capture(log=False)
    key = graphs.key_for(inputs)
    assert key is not None
    empty = (writes[0][:0], writes[1][:0])

    @torch.inference_mode()
    def run_graph() -> None:
        out = graphs.run(key, inputs, empty)
        if isinstance(graphs, PrefillGraphs):  # the sampled rows' logits, as the runner
            model.compute_logits(out[0])

    return run_graph


def isolated_times(run: Callable[[], None], iters: int, device: torch.device) -> list[float]:
    """Seconds of each of ``iters`` calls of ``run``, each issued to an idle device and
    waited for (a GPU: between two CUDA events, so the host's staging and launch count)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return times


def pipelined_times(run: Callable[[], None], iters: int, depth: int = 2) -> list[float]:
    """Seconds of each of ``iters`` GPU steps issued back to back, as the asynchronous
    engine issues them: the host stages and launches step i while step i - 1 runs, at most
    ``depth`` steps queued (it waits for step i - depth's end first, as the engine waits
    for a step's output before it reuses its staging buffer). Each time is the span
    between consecutive steps' end events: the device's time per step once the host's is
    hidden (the first also holds the first launch)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        if i >= depth:
            events[i + 1 - depth].synchronize()
        run()
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]


def roofline(model: DeepseekV4ForCausalLM, batch: BatchSpec, hardware: str | None) -> dict:
    """Bytes, FLOPs and the roofline time of the step (planner counting, this dtype)."""
    element = model.head.weight.element_size()
    precision = {2: "bf16", 4: "fp32"}.get(element, "bf16")
    # quantized weights: the bytes stored (FP8 + block scales; FP4 + a scale per 32 values);
    # the matmuls still run at the activations' precision (weights widened in registers)
    q = model.cfg.quantization
    weight_bytes, expert_bytes = float(element), float(element)
    if q is not None:
        scale = 1 if q.scale_fmt == "ue8m0" else 4
        weight_bytes = 1 + 4 / (128 * 128)
        expert_bytes = 0.5 + scale / 32 if q.expert_dtype == "fp4" else 1 + scale / (128 * 128)
    formats = Formats(
        weight_bytes=weight_bytes,
        expert_bytes=expert_bytes,
        kv_bytes=element,
        act_bytes=element,
        dispatch_bytes=element,
        gemm_precision="bf16",
        expert_precision="bf16",
        attention_precision="bf16",
        indexer_precision="bf16",
    )
    shape = BatchShape(batch.num_requests, batch.new_tokens, batch.context)
    ops = step_ops(model.cfg, shape, formats, ep_size=1, logits_tokens=batch.num_requests)
    if batch.decode_requests:
        decode = BatchShape(batch.decode_requests, 1, batch.decode_context)
        ops = _merge_ops(
            ops, step_ops(model.cfg, decode, formats, 1, logits_tokens=batch.decode_requests)
        )
    out = {
        "flops": sum(o.flops for o in ops),
        "bytes": sum(o.bytes for o in ops),
        "precision": precision,
    }
    if hardware is not None:
        gpu = get_hardware(hardware)
        out["hardware"] = gpu.name
        out["roofline_s"] = roofline_time(ops, gpu)
    return out


def _merge_ops(a: list[OpCost], b: list[OpCost]) -> list[OpCost]:
    """The ops of one step holding both batches: FLOPs add; bytes are each op's larger
    count (the weights, most of the bytes, are read once for both): a lower bound of the
    bytes, so the roofline fraction of a mixed step is not flattered."""
    merged = {op.name: op for op in a}
    for op in b:
        prev = merged.get(op.name)
        if prev is None:
            merged[op.name] = op
            continue
        read = max(prev.bytes_read, op.bytes_read)
        written = max(prev.bytes_written, op.bytes_written)
        merged[op.name] = replace(
            prev,
            flops=prev.flops + op.flops,
            bytes_read=read,
            bytes_written=written,
            launches=max(prev.launches, op.launches),
        )
    return list(merged.values())
