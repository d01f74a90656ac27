"""How much KV cache an engine core gets: the byte budget (``--kv-cache-memory-bytes``,
else this instance's ``--gpu-memory-utilization`` share less what it already holds), the
caches' storage dtype (``--kv-cache-dtype``) and the plan: the model's cache groups and the
blocks of each that the budget buys, refused when one ``--max-model-len`` request would not
fit.

``EngineCore`` reads the GPU's memory in use before it loads the weights and sizes the
caches after; ``plan_kv_cache`` loads no weights, so ``rackserve serve``'s preflight also
runs it before any process starts.
"""

from __future__ import annotations

import math

import torch

from rackserve.config import CPU_KV_CACHE_MEMORY, EngineConfig
from rackserve.kv.spec import CacheGroupSpec, bytes_per_token, capacity_tokens, plan_num_blocks
from rackserve.spec_decode.checkpoint import spec_cache_groups


def device_memory_in_use(device: torch.device) -> int:
    """Bytes of the GPU in use by every process (0 off a GPU): taken before the weights
    load, it is what this instance's ``--gpu-memory-utilization`` share does not cover."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def kv_budget_bytes(
    config: EngineConfig, device: torch.device, in_use_at_start: int = 0, reserve: int = 0
) -> int:
    """``--kv-cache-memory-bytes``, else what ``--gpu-memory-utilization`` leaves. As in
    vLLM, the fraction is a per-instance limit: this instance (weights, activations, KV
    cache, CUDA graphs) may use that share of the GPU's total memory, whatever other
    processes on the GPU hold, so two engines at 0.45 each share one GPU. ``in_use_at_start``:
    the GPU's memory in use before this instance loaded anything (``device_memory_in_use``);
    what has been added since is this instance's own and comes off its share, and so does
    ``reserve``: the steps' activations and the graphs (``runner.memory_profile``), and a
    draft model's weights (``model.loader.checkpoint_weight_bytes``)."""
    if config.cache.kv_cache_memory is not None:
        return config.cache.kv_cache_memory
    if device.type != "cuda":
        return CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    utilization = config.cache.gpu_memory_utilization
    share = int(total * utilization)
    if share > total - in_use_at_start:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} asks for {share / 2**30:.1f} GiB, but "
            f"only {(total - in_use_at_start) / 2**30:.1f} GiB of the GPU were free at start "
            f"(other processes held {in_use_at_start / 2**30:.1f} GiB): lower it, or give "
            "--kv-cache-memory-bytes"
        )
    own = (total - free) - in_use_at_start
    budget = share - own - reserve
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} allows this instance "
            f"{share / 2**30:.1f} GiB, but its weights take {own / 2**30:.1f} GiB and its "
            f"largest step, CUDA graphs and draft model {reserve / 2**30:.1f} GiB: raise it, "
            "lower --max-num-batched-tokens, or give --kv-cache-memory-bytes"
        )
    return budget


def kv_cache_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The KV groups' storage for ``--kv-cache-dtype`` (None: the model dtype). fp8: e4m3
    window rows, compressed entries and indexer keys on every device: the reference ops
    and the Triton kernels share one rule (``ops/triton/fp8.py``: the activation-dtype
    value cast to e4m3, no scale, saturating); the compressor state stays in the model
    dtype. ``device`` is kept for the kernels a device may lack (none today)."""
    del device
    return torch.float8_e4m3fn if name == "fp8" else None


def cache_groups(config: EngineConfig, dtype: torch.dtype) -> list[CacheGroupSpec]:
    """The model's cache groups, then its drafter's (MTP: one more swa layer; a draft
    model: its own)."""
    element = torch.tensor([], dtype=dtype).element_size()
    kv_element = 1 if config.cache.kv_cache_dtype == "fp8" else element
    return spec_cache_groups(config.speculative, config.model_config, kv_element, element)


def plan_kv_cache(
    config: EngineConfig, dtype: torch.dtype, budget_bytes: int
) -> tuple[list[CacheGroupSpec], dict[str, int]]:
    """Cache groups of the model and blocks per group for a budget; ValueError naming the
    fix when the budget is too small (cheap: no weights are loaded)."""
    groups = cache_groups(config, dtype)
    sched = config.scheduler
    num_blocks = plan_num_blocks(
        groups, budget_bytes, sched.max_num_seqs, sched.max_num_batched_tokens
    )
    # A request may grow to max_model_len: if the whole cache cannot hold it, it would
    # preempt itself forever (vLLM refuses to start too).
    capacity = capacity_tokens(groups, num_blocks)
    full = [g for g in groups if not g.is_sliding]
    if full and capacity < sched.max_model_len:
        missing = sched.max_model_len - capacity
        # the missing tokens, plus a block per group for plan_num_blocks' rounding
        needed = budget_bytes + math.ceil(missing * bytes_per_token(groups))
        needed += sum(g.bytes_per_block for g in full)
        raise ValueError(
            f"the KV cache holds {capacity} tokens, fewer than one request of --max-model-len "
            f"{sched.max_model_len}: raise --kv-cache-memory to at least {needed} bytes "
            f"({needed / 2**20:.1f} MiB) or lower --max-model-len"
        )
    return groups, num_blocks
