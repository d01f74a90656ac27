"""The engine core: one step = schedule -> execute -> update.

It works on token ids only. Building it loads the checkpoint, derives the cache groups
from the model, sizes the KV pools from the memory budget (``engine/kv_budget.py``) and
prints the capacity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from rackserve.config import EngineConfig
from rackserve.device import resolve
from rackserve.engine.async_scheduling import (
    InFlight,
    check_supported,
    is_async,
    mark_placeholders,
    update_after_collect,
)
from rackserve.engine.kv_budget import (
    cache_groups,
    device_memory_in_use,
    kv_budget_bytes,
    kv_cache_dtype,
    plan_kv_cache,
)
from rackserve.engine.outputs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RunnerOutput,
    SchedulerOutput,
)
from rackserve.engine.scheduler import Scheduler
from rackserve.engine.step_phases import phase
from rackserve.kv.events import KVEvents
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.offload.build import build_offloader
from rackserve.kv.spec import bytes_per_token, capacity_tokens, prefix_alignment
from rackserve.model.loader import checkpoint_weight_bytes, load_model
from rackserve.moe.ep import expert_parallel_models
from rackserve.moe.skew import apply_skewed_routing
from rackserve.parallel.groups import ParallelGroups
from rackserve.request import INT64_MAX, INT64_MIN, Request, RequestStatus
from rackserve.runner.kv_transfer import export_blocks, import_blocks
from rackserve.runner.memory_profile import runner_reserve_bytes
from rackserve.runner.model_runner import ModelRunner
from rackserve.runner.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)
# How long an engine with nothing to run but compiling grammars waits per (empty) step
GRAMMAR_POLL_S = 0.01


class EngineCore:
    """One engine core; with DEP, one DP rank (``groups``: this rank's process groups, from
    ``parallel.init_distributed``). Every rank of a DEP instance must call ``step()``
    together (``engine/dp.py`` syncs them); a rank with no work runs the dummy pass."""

    def __init__(
        self, config: EngineConfig, log_stats: bool = True, groups: ParallelGroups | None = None
    ) -> None:
        self.config = config
        check_supported(config)  # --async-scheduling's combinations, before loading anything
        device, dtype = resolve(config.device, config.dtype)
        torch.manual_seed(config.seed)
        if device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.groups = groups or ParallelGroups.single()
        # EP state per model (moe/ep.py): "main" (self.ep) and the MTP layers' "mtp"
        in_use_at_start = device_memory_in_use(device)  # other processes' share of the GPU
        self.ep_models = expert_parallel_models(config, self.groups, device)
        self.ep = self.ep_models.get("main")
        self.model = load_model(
            config.model,
            dtype=dtype,
            device=device,
            expert_parallel=self.ep,
            mtp_expert_parallel=self.ep_models.get("mtp"),
        )
        if config.parallel.skewed_routing > 0:
            apply_skewed_routing(self.model, config.parallel.skewed_routing, seed=config.seed)
        if device.type == "cuda":  # blocks the loading freed (casts, reads) are no weights
            torch.cuda.empty_cache()
        cfg = self.model.cfg
        self.eos_token_ids = cfg.eos_token_id
        self.max_model_len = config.scheduler.max_model_len
        sched = config.scheduler
        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, device)
        # a GPU's share also covers the largest step, the graphs and a draft model's weights
        # (loaded by the runner, after the KV cache); EP engines are not profiled
        reserve = 0
        on_share = config.cache.kv_cache_memory is None and device.type == "cuda"
        if on_share and self.ep is None:
            spec = config.speculative
            reserve = runner_reserve_bytes(
                self.model,
                cache_groups(config, dtype),
                sched.max_num_seqs,
                sched.max_model_len,
                sched.max_num_batched_tokens,
                graphs=not config.enforce_eager,
                kv_dtype=kv_dtype,
                speculative=spec is not None,
            )
            if spec is not None and spec.model is not None:
                reserve += checkpoint_weight_bytes(spec.model, dtype)
            if log_stats:
                print(f"memory: {reserve / 2**30:.2f} GiB kept beside the KV cache (the largest "
                      "step, CUDA graphs, a draft model)", flush=True)  # fmt: skip
        groups, num_blocks = plan_kv_cache(
            config, dtype, kv_budget_bytes(config, device, in_use_at_start, reserve)
        )
        interval = config.cache.checkpoint_interval
        cache = config.cache
        kv = KVCacheManager(
            groups,
            num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
            checkpoint_interval=_round_interval(interval, groups),
            # the host KV pool copies evicted blocks; KV events publish key changes
            record_events=cache.uses_kv_pool or cache.kv_events_endpoint is not None,
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
            kv_cache_dtype=kv_dtype,
            speculative=spec,
            max_num_batched_tokens=sched.max_num_batched_tokens,
        )
        self.offload = build_offloader(cache, kv, self.runner.caches, dtype)
        self.kv_events = KVEvents(kv, cache.kv_events_endpoint, self.offload, self.groups.rank)
        self.scheduler = Scheduler(
            sched, kv, cfg.eos_token_id, self.offload, num_spec_tokens=num_spec_tokens
        )
        self.last_step: SchedulerOutput | None = None
        # --async-scheduling: the launched step not collected yet (engine/async_scheduling.py)
        self.async_scheduling = is_async(config, device)
        self._in_flight: InFlight | None = None
        self.last_forward_time_s = 0.0
        self.last_propose_time_s = 0.0  # drafts proposed on the device (RunnerOutput)
        self.kv_connector = None
        if config.kv_transfer is not None:  # P/D disaggregation (disagg/connector.py)
            from rackserve.disagg.connector import KVConnector

            self.kv_connector = KVConnector(
                config.kv_transfer, self.scheduler, self.runner.caches, dtype, device
            )

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (the client's fault) leaves the engine untouched.
        A structured-output request waits in the scheduler until its grammar compiles; a
        P/D decode-side request (``kv_transfer_params``) until its KV lands."""
        if request.sampling_params.kv_transfer_params is not None:
            if self.kv_connector is None:
                raise ValueError(
                    "kv_transfer_params given, but this engine has no --kv-transfer-config"
                )
            prepared = self.kv_connector.prepare(request)
            if prepared is None:  # decode side: held until its KV lands
                self.kv_connector.add_remote(self._request(request))
                return
            request = prepared
        req = self._request(request)
        params = request.sampling_params.kv_transfer_params
        if params is not None and params.do_remote_decode:
            req.kv_commit_lag = 1  # the decode side recomputes the last prompt token
        structured = request.sampling_params.structured_outputs
        # the compile _request started (the compiler's cache finds it)
        grammar = self.grammar_compiler.submit(structured) if structured is not None else None
        self.scheduler.add_request(req, grammar, self.config.structured_output_timeout_s)

    def add_request_with_kv(self, request: EngineCoreRequest, num_computed_tokens: int) -> bool:
        """Admit a request whose first tokens' KV lands straight in its blocks (P/D decode
        side, ``bench decode``'s synthetic contexts); False when there is no room now."""
        self.flush_kv_exports()  # the blocks it gets may be ones a finished prefill held
        added = self.scheduler.add_request_with_kv(self._request(request), num_computed_tokens)
        self.kv_events.drain()  # blocks it evicted are copied before its KV overwrites them
        return added

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
        # a step still in flight is collected by one more step(), as are outputs made
        # between steps (a P/D request's first token, which may also have finished it) and
        # the KV exports of finished prefills that no loop ran after sending (flush_kv_exports)
        sched, connector = self.scheduler, self.kv_connector
        return (
            sched.num_unfinished > 0
            or self._in_flight is not None
            or sched.has_outputs
            or (connector is not None and connector.has_pending_exports)
        )

    def flush_kv_exports(self) -> None:
        """P/D prefill side: copy the KV of the requests the last step finished into the
        store. Their blocks are freed at once, but the copy (a gather per cache tensor) waits
        until the loop has sent the step's outputs: t1's answer leaves first. ``step()``
        runs it first too, so a loop that never calls it only answers later."""
        if self.kv_connector is not None:
            self.kv_connector.export_finished()

    def take_outputs(self) -> EngineCoreOutputs | None:
        """Outputs made between steps (a P/D request's first token, emitted on arrival),
        for the loop to send before the next step's work; None when there are none."""
        outputs = self.scheduler.take_outputs()
        if not outputs:
            return None
        stats = self.scheduler.stats()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        connector = self.kv_connector
        if connector is not None:
            connector.export_finished()  # the last step's prefills, if the loop did not
            connector.wait()  # naps only when nothing but remote-KV requests exist
            connector.step()
        with phase("schedule"):
            sched = self.scheduler.schedule()
        if connector is not None:  # a prefill schedule() finished: copied before the forward
            connector.export_finished()
        self.last_step = sched
        if (
            not sched.total_num_scheduled_tokens
            and self.scheduler.waiting_for_grammar
            and self._in_flight is None
        ):
            # only grammars are compiling: wait a little for one instead of spinning
            self.scheduler.waiting_for_grammar.wait(GRAMMAR_POLL_S)
        if not sched.total_num_scheduled_tokens and self.offload is not None:
            # only host-pool loads are pending: nap until one lands instead of spinning
            # (a spinning engine thread starves the load thread and the pool server)
            self.offload.wait_for_loads(GRAMMAR_POLL_S)
        self.kv_events.drain()  # evicted blocks go to the host pool before the forward
        if self.async_scheduling:
            outputs = self._step_async(sched)
        else:
            result = self.runner.execute(sched)  # an empty step still drops finished state
            if self.ep is not None:
                if not result.req_ids:
                    self.ep.dummy_pass()  # no forward ran: the other ranks' dispatch needs ours
                self.ep_models.end_step(("main",))  # the MTP layers run in no step yet
            self.last_forward_time_s = result.forward_time_s
            self.last_propose_time_s = result.propose_time_s
            with phase("update"):
                outputs = self.scheduler.update(sched, result)
        self.kv_events.drain(publish=True)
        stats = self.scheduler.stats()
        if self.offload is not None:
            pool = self.offload.stats
            stats.prefix_cache_pool_hits = self.scheduler.kv.stats.num_pool_hit_tokens
            stats.kv_offload_bytes, stats.kv_load_bytes = pool.bytes_offloaded, pool.bytes_loaded
            stats.kv_pool_usage = pool.pool_used_bytes / max(1, pool.pool_capacity_bytes)
        if connector is not None:
            stats.num_waiting_for_remote_kv = connector.num_waiting
            stats.kv_bytes_received = connector.num_bytes_received
        if self.ep is not None and self.ep.last_balancedness is not None:
            real, uniform = self.ep.last_balancedness
            stats.expert_balancedness, stats.expert_balancedness_uniform = real, uniform
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    def _step_async(self, sched: SchedulerOutput) -> list:
        """Launch ``sched`` (step N+1), then collect and apply step N: the host work of
        N+1 ran while N was on the device. An empty step is collected at once, so a step
        stays in flight only while there is work."""
        marked = mark_placeholders(self.scheduler, sched)
        launched = InFlight(sched, self.runner.launch(sched), marked)
        done, self._in_flight = self._in_flight, launched
        if done is None:  # nothing was in flight: only what schedule() finished
            outputs = self.scheduler.update(sched, RunnerOutput(req_ids=[], sampled_token_ids=[]))
        else:
            result = self.runner.collect(done.handle)
            self.last_forward_time_s = result.forward_time_s
            self.last_propose_time_s = result.propose_time_s
            with phase("update"):
                outputs = update_after_collect(self.scheduler, done, result, launched)
        if not sched.total_num_scheduled_tokens:
            self._in_flight = None
            result = self.runner.collect(launched.handle)
            outputs += update_after_collect(self.scheduler, launched, result, None)
        return outputs

    # ---- KV export / import (P/D transfer, host KV pool) -----------------------------------
    def export_kv(self, request_id: str) -> tuple[tuple[list[int], ...], torch.Tensor]:
        """A running request's block tables and its KV as one packed region."""
        req = self.scheduler.requests[request_id]
        block_ids = self.scheduler.kv.get_block_ids(req)
        return block_ids, export_blocks(self.runner.caches, block_ids)

    def import_kv(self, request_id: str, packed: torch.Tensor) -> None:
        """Fill a running request's blocks from a packed region."""
        req = self.scheduler.requests[request_id]
        self.kv_events.drain()
        import_blocks(self.runner.caches, self.scheduler.kv.get_block_ids(req), packed)

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, message) of requests ended by an error since the last call (a
        failed KV transfer under kv_load_failure_policy "fail")."""
        return [] if self.kv_connector is None else self.kv_connector.take_errors()

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.abort_requests(list(self.scheduler.requests))
        self.grammar_compiler.shutdown()
        self.runner.device_queue.close()
        self.kv_events.close()
        if self.offload is not None:
            self.offload.close()


def _round_interval(interval: int | None, groups: list) -> int | None:
    """Round the checkpoint interval to the prefix alignment of this model."""
    if interval is None:
        return None
    a = prefix_alignment(groups)
    return max(a, interval // a * a)
