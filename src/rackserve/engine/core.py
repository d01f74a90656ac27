"""The engine core: one step = schedule -> execute -> update.

It works on token ids only. Building it loads the checkpoint, derives the cache groups
from the model, sizes the KV pools from the memory budget and prints the capacity.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

import torch

from rackserve.config import CPU_KV_CACHE_MEMORY, EngineConfig
from rackserve.device import resolve
from rackserve.engine.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput
from rackserve.engine.scheduler import Scheduler
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.spec import (
    CacheGroupSpec,
    bytes_per_token,
    capacity_tokens,
    plan_num_blocks,
    prefix_alignment,
)
from rackserve.model.loader import load_model
from rackserve.moe.ep import ExpertParallel
from rackserve.moe.skew import apply_skewed_routing
from rackserve.parallel.groups import ParallelGroups
from rackserve.request import INT64_MAX, INT64_MIN, Request, RequestStatus
from rackserve.runner.kv_transfer import export_blocks, import_blocks
from rackserve.runner.model_runner import ModelRunner
from rackserve.runner.structured_output import GrammarCompiler
from rackserve.spec_decode.proposer import spec_cache_groups

logger = logging.getLogger(__name__)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """``--kv-cache-memory-bytes``, else what ``--gpu-memory-utilization`` leaves: as in
    vLLM, the whole instance (weights, activations, KV cache) may use that fraction of the
    GPU's total memory, so the memory in use once the weights are loaded comes off."""
    if config.cache.kv_cache_memory is not None:
        return config.cache.kv_cache_memory
    if device.type != "cuda":
        return CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    utilization = config.cache.gpu_memory_utilization
    budget = int(total * utilization) - (total - free)
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} allows {total * utilization / 2**30:.1f} "
            f"GiB, but {(total - free) / 2**30:.1f} GiB are already in use (weights, other "
            "processes): raise it, or give --kv-cache-memory-bytes"
        )
    return budget


def plan_kv_cache(
    config: EngineConfig, dtype: torch.dtype, budget_bytes: int
) -> tuple[list[CacheGroupSpec], dict[str, int]]:
    """Cache groups of the model and blocks per group for a budget; ValueError naming the
    fix when the budget is too small (cheap: no weights are loaded)."""
    element = torch.tensor([], dtype=dtype).element_size()
    # the target's groups, then its drafter's (MTP: one more swa layer; a draft model: its own)
    groups = spec_cache_groups(config.speculative, config.model_config, element)
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


class EngineCore:
    """One engine core; with DEP, one DP rank (``groups``: this rank's process groups, from
    ``parallel.init_distributed``). Every rank of a DEP instance must call ``step()``
    together (``engine/dp.py`` syncs them); a rank with no work runs the dummy pass."""

    def __init__(
        self, config: EngineConfig, log_stats: bool = True, groups: ParallelGroups | None = None
    ) -> None:
        self.config = config
        device, dtype = resolve(config.device, config.dtype)
        torch.manual_seed(config.seed)
        if device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.groups = groups or ParallelGroups.single()
        self.ep = _expert_parallel(config, self.groups, device)
        self.model = load_model(config.model, dtype=dtype, device=device, expert_parallel=self.ep)
        if config.parallel.skewed_routing > 0:
            apply_skewed_routing(self.model, config.parallel.skewed_routing, seed=config.seed)
        cfg = self.model.cfg
        self.eos_token_ids = cfg.eos_token_id
        self.max_model_len = config.scheduler.max_model_len
        sched = config.scheduler
        groups, num_blocks = plan_kv_cache(config, dtype, kv_budget_bytes(config, device))
        interval = config.cache.checkpoint_interval
        kv = KVCacheManager(
            groups,
            num_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            hash_algo=config.cache.prefix_caching_hash_algo,
            checkpoint_interval=_round_interval(interval, groups),
        )
        self.kv_capacity_tokens = capacity_tokens(groups, num_blocks)
        self.kv_bytes_per_token = bytes_per_token(groups)
        if log_stats:
            print(
                f"KV cache: capacity {self.kv_capacity_tokens} tokens, "
                f"{self.kv_bytes_per_token:.0f} bytes/token of history, "
                f"prefix alignment {kv.alignment} tokens",
                flush=True,
            )
        spec = config.speculative
        num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens
        self.scheduler = Scheduler(sched, kv, cfg.eos_token_id, num_spec_tokens)
        self.grammar_compiler = GrammarCompiler(
            config.tokenizer or config.model, cfg.vocab_size, cfg.eos_token_id
        )
        self.runner = ModelRunner(
            self.model,
            groups,
            num_blocks,
            sched.max_num_seqs,
            sched.max_model_len,
            cfg.eos_token_id,
            config.seed,
            # EP dispatch reads split sizes on the host: no CUDA graphs.
            enforce_eager=config.enforce_eager or self.ep is not None,
            log=log_stats,
            grammar_compiler=self.grammar_compiler,
            speculative=spec,
        )
        self.last_step: SchedulerOutput | None = None
        self.last_forward_time_s = 0.0

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (the client's fault) leaves the engine untouched."""
        self.scheduler.add_request(self._request(request))

    def add_request_with_kv(self, request: EngineCoreRequest, num_computed_tokens: int) -> bool:
        """Admit a request whose first tokens' KV lands straight in its blocks (P/D decode
        side, ``bench decode``'s synthetic contexts); False when there is no room now."""
        return self.scheduler.add_request_with_kv(self._request(request), num_computed_tokens)

    def _request(self, request: EngineCoreRequest) -> Request:
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        # A value the runner's tables cannot hold would fail inside step() and take every
        # other request down with it: refuse it here, where only this request fails.
        request.sampling_params.check_vocab(vocab)
        if not INT64_MIN <= request.priority <= INT64_MAX:
            raise ValueError(f"priority must fit in a signed 64-bit integer: {request.priority}")
        structured = request.sampling_params.structured_outputs
        if structured is not None:  # ValueError for a bad grammar; compiles while it waits
            self.grammar_compiler.submit(structured)
        return Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        self.last_step = sched
        result = self.runner.execute(sched)  # an empty step still drops finished state
        if self.ep is not None:
            if not result.req_ids:
                self.ep.dummy_pass()  # no forward ran: the other ranks' dispatch needs ours
            self.ep.end_step()
        self.last_forward_time_s = result.forward_time_s
        outputs = self.scheduler.update(sched, result)
        stats = self.scheduler.stats()
        if self.ep is not None and self.ep.last_balancedness is not None:
            real, uniform = self.ep.last_balancedness
            stats.expert_balancedness, stats.expert_balancedness_uniform = real, uniform
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    # ---- KV export / import (P/D transfer, host KV pool) -----------------------------------
    def export_kv(self, request_id: str) -> tuple[tuple[list[int], ...], torch.Tensor]:
        """A running request's block tables and its KV as one packed region."""
        req = self.scheduler.requests[request_id]
        block_ids = self.scheduler.kv.get_block_ids(req)
        return block_ids, export_blocks(self.runner.caches, block_ids)

    def import_kv(self, request_id: str, packed: torch.Tensor) -> None:
        """Fill a running request's blocks from a packed region."""
        req = self.scheduler.requests[request_id]
        import_blocks(self.runner.caches, self.scheduler.kv.get_block_ids(req), packed)

    def shutdown(self) -> None:
        self.abort_requests(list(self.scheduler.requests))
        self.grammar_compiler.shutdown()


def _expert_parallel(
    config: EngineConfig, groups: ParallelGroups, device: torch.device
) -> ExpertParallel | None:
    """This rank's share of the routed experts under ``--enable-expert-parallel``."""
    par = config.parallel
    if not par.expert_parallel:
        return None
    if groups.ep_size != par.expert_parallel_size:
        raise ValueError(
            f"expert parallelism over {par.expert_parallel_size} ranks needs process groups of "
            f"that size (got {groups.ep_size}): launch the ranks with engine/dp.py"
        )
    cfg = config.model_config
    return ExpertParallel(
        cfg.num_hidden_layers,
        cfg.n_routed_experts,
        par.num_physical_experts(cfg.n_routed_experts),
        groups,
        device,
        eplb=par.eplb if par.enable_eplb else None,
        window_size=par.eplb.window_size,
    )


def _round_interval(interval: int | None, groups: list) -> int | None:
    """Round the checkpoint interval to the prefix alignment of this model."""
    if interval is None:
        return None
    a = prefix_alignment(groups)
    return max(a, interval // a * a)
