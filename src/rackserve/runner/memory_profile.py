"""What a runner needs on the GPU beside its weights and KV cache, measured before the KV
cache is sized (vLLM's profile run): ``--gpu-memory-utilization`` is this instance's share
of the GPU (weights, activations, KV cache and CUDA graphs), so the KV budget is that share
less the weights, less what the largest step and the graphs hold.

``step_peak_bytes`` runs one synthetic prefill of the largest step (``bench.forward``'s
synthetic step: one request, its own small caches) and reads the allocator's peak:
activations, workspaces, the sampled row's logits, and the step's own caches (V4's
compressed KV: tens of MB for 8K tokens of a full model, small beside the activations;
counting them errs on the safe side).
``graph_capture_bytes`` measures the step graphs: it captures every one of them, as the
runner will, on a cache of two blocks a group (a graph's memory does not depend on the
cache's size: padded rows read the null block), and reads what the capture held at its
peak and what the graphs keep (their pool, outputs and static inputs). vLLM's profile does
the same for a sample of its graphs (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``); this
one captures them all, so nothing is extrapolated. The estimate it replaced (the largest
graph's peak, twice, plus the outputs) had left 0.49 GiB for graphs that held 0.71 GiB
(bench decode, 64 requests, H100: benchmarks/results/2026-12-06-s27.md): one pool
of differently shaped captures fragments.
``runner_reserve_bytes`` puts them together. A speculating runner captures its drafter's
graphs instead (spec_decode/graphs.py), which need the draft model: for it the estimate
stays.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import KVCacheTensors
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.cuda_graph import (
    capture_step_graphs,
    context_buckets,
    graph_batch_sizes,
    prefill_graph_buckets,
    prefill_graph_sizes,
)
from rackserve.runner.inputs import BlockTables, ring_widths
from rackserve.runner.step_buffers import StepBuffers


@torch.inference_mode()
def run_synthetic_prefill(
    model: DeepseekV4ForCausalLM, num_tokens: int, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One eager prefill step of ``num_tokens`` tokens (one request, its own caches) through
    the sampled row's logits, as the runner runs it; returns those logits [1, V]."""
    # bench.forward pulls in the planner: imported when a profile runs, not with the engine
    from rackserve.bench.forward import BatchSpec, synthetic_step

    device = next(model.parameters()).device
    step = synthetic_step(model, BatchSpec("prefill", 1, num_tokens, 0), kv_dtype=kv_dtype)
    buffers = StepBuffers(step.groups, step.input_batch.block_tables, device)
    input_ids, meta, logits_indices = buffers.eager_step(step.step.inputs, step.step.table_writes)
    hidden, _ = model(input_ids, meta, step.caches)
    return model.compute_logits(hidden[logits_indices])


def step_peak_bytes(
    model: DeepseekV4ForCausalLM, num_tokens: int, kv_dtype: torch.dtype | None = None
) -> int:
    """Peak bytes ``run_synthetic_prefill`` allocates beyond the weights and its step's
    caches (0 off a GPU: nothing to measure, and nothing the budget reserves there)."""
    device = next(model.parameters()).device
    if device.type != "cuda" or num_tokens <= 0:
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_synthetic_prefill(model, num_tokens, kv_dtype)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(peak, 0)


def graph_outputs_bytes(
    model: DeepseekV4ForCausalLM, max_num_reqs: int, max_model_len: int, max_step_tokens: int
) -> int:
    """The graphs' outputs that stay alive in their pool: each prefill graph's hidden states
    [T, D] per context bucket it serves, and the decode graphs' one logits buffer [B, V]."""
    cfg = model.cfg
    dtype_bytes = model.head.weight.element_size()
    served = prefill_graph_buckets(context_buckets(max_model_len))
    hidden = sum(prefill_graph_sizes(max_step_tokens)) * cfg.hidden_size * dtype_bytes
    logits = max(graph_batch_sizes(max_num_reqs)) * cfg.vocab_size * 4
    return hidden * len(served) + logits


def graph_capture_bytes(
    model: DeepseekV4ForCausalLM,
    groups: Sequence[CacheGroupSpec],
    max_num_reqs: int,
    max_model_len: int,
    max_step_tokens: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """(held, peak): the bytes the runner's step graphs keep once captured, and the most
    their capture held at once (the graphs so far with the next one's warm-up beside
    them), measured by capturing them all on a cache of two blocks a group, then freed;
    neither counts what stays allocated after (the libraries' workspaces). (0, 0) off a
    GPU."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 0, 0
    dtype = model.head.weight.dtype
    caches = KVCacheTensors(groups, {g.name: 2 for g in groups}, dtype, device, kv_dtype)
    block_tokens = {g.name: g.block_tokens for g in groups}
    tables = BlockTables(
        block_tokens, max_num_reqs, max_model_len, ring_widths(groups, max_step_tokens)
    )
    buffers = StepBuffers(groups, tables, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    graphs = capture_step_graphs(
        model, caches, buffers, groups, max_num_reqs, max_model_len, max_step_tokens, log=False
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - before
    held = torch.cuda.memory_reserved(device) - before  # the warm-ups' cache was emptied
    del graphs, caches, buffers
    gc.collect()  # nothing of the capture may outlive it through a reference cycle
    torch.cuda.empty_cache()
    # What outlives the capture is cuBLAS's workspace of each stream it first ran on (32 MiB
    # each for the warm-up and the capture stream: benchmarks/memory_profile_probe.py); the
    # runner's capture reuses them, and the KV budget counts them as this instance's own
    kept = torch.cuda.memory_reserved(device) - before
    return held - kept, max(peak, held) - kept


def runner_reserve_bytes(
    model: DeepseekV4ForCausalLM,
    groups: Sequence[CacheGroupSpec],
    max_num_reqs: int,
    max_model_len: int,
    max_step_tokens: int,
    graphs: bool,
    kv_dtype: torch.dtype | None = None,
    speculative: bool = False,
) -> int:
    """Bytes the KV budget leaves for a runner's steps: the peak of its largest eager step;
    with CUDA graphs, the larger of the graphs' capture peak and what they keep beside that
    eager peak (eager steps run outside their pool). ``speculative``: the runner captures
    its drafter's graphs, estimated (the largest graph's peak, its warm-up's beside the
    pool, and the outputs)."""
    largest = min(max_step_tokens, max_model_len)
    eager = step_peak_bytes(model, largest, kv_dtype)
    if not (graphs and eager):
        return eager
    if not speculative:
        held, peak = graph_capture_bytes(
            model, groups, max_num_reqs, max_model_len, largest, kv_dtype
        )
        return max(peak, held + eager)
    graph_tokens = max(max(prefill_graph_sizes(largest)), max(graph_batch_sizes(max_num_reqs)))
    graph = eager if graph_tokens == largest else step_peak_bytes(model, graph_tokens, kv_dtype)
    outputs = graph_outputs_bytes(model, max_num_reqs, max_model_len, largest)
    return max(eager, graph) + graph + outputs
