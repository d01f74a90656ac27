"""What a runner needs on the GPU beside its weights and KV cache, measured before the KV
cache is sized (vLLM's profile run): ``--gpu-memory-utilization`` is this instance's share
of the GPU (weights, activations, KV cache and CUDA graphs), so the KV budget is that share
less the weights, less what the largest step and the graphs hold.

``step_peak_bytes`` runs one synthetic prefill of the largest step (``bench.forward``'s
synthetic step: one request, its own small caches) and reads the allocator's peak:
activations, workspaces, the sampled row's logits, and the step's own caches (V4's
compressed KV: tens of MB for 8K tokens of a full model, small beside the activations;
counting them errs on the safe side).
``runner_reserve_bytes`` adds the graphs: their pool holds the largest captured step's
peak (graphs are captured largest first into one pool, each reusing the last one's
intermediates), the prefill graphs' hidden-state outputs and the decode graphs' logits.
"""

from __future__ import annotations

import torch

from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.cuda_graph import (
    context_buckets,
    graph_batch_sizes,
    prefill_graph_buckets,
    prefill_graph_sizes,
)
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


def runner_reserve_bytes(
    model: DeepseekV4ForCausalLM,
    max_num_reqs: int,
    max_model_len: int,
    max_step_tokens: int,
    graphs: bool,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Bytes the KV budget leaves for a runner's steps: the peak of its largest eager step,
    and with CUDA graphs their pool (the largest graph's peak and the outputs) beside the
    larger of that peak and the largest graph's warm-up."""
    largest = min(max_step_tokens, max_model_len)
    eager = step_peak_bytes(model, largest, kv_dtype)
    if not (graphs and eager):
        return eager
    # the largest graph: a padded prefill, or the largest decode (the eager step's own
    # size when they match, measured once)
    graph_tokens = max(max(prefill_graph_sizes(largest)), max(graph_batch_sizes(max_num_reqs)))
    graph = eager if graph_tokens == largest else step_peak_bytes(model, graph_tokens, kv_dtype)
    # while the graphs are captured, the largest one's eager warm-up holds its peak beside
    # the pool: more than the eager step when the largest graph is padded past it
    outputs = graph_outputs_bytes(model, max_num_reqs, max_model_len, largest)
    return max(eager, graph) + graph + outputs
