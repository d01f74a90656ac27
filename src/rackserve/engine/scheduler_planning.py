"""One step's plan (``SchedulerPlanning.schedule``): which requests compute how many tokens
under the step's token budget, and preemption when the cache is full.

Running requests are served first, in order (a decode step, a prefill chunk and a recompute
are all "the next ``n`` tokens", capped by ``long_prefill_token_threshold``); then waiting
ones (prefix-cache hit, host-pool loads, chunked prefill) unless the step had to preempt.
The victim is always the running request that would be scheduled last, so it is never one
already in the step's batch; a request that cannot fit even alone is finished ('length').
"""

from __future__ import annotations

import logging
import time

from rackserve.engine.async_scheduling import past_last_token
from rackserve.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    SchedulerOutput,
)
from rackserve.engine.scheduler_requests import SchedulerRequests
from rackserve.kv.offload import LoadStart
from rackserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class SchedulerPlanning(SchedulerRequests):
    """``schedule()`` and the preemption it does; a base of ``Scheduler``."""

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_compiled()
        if self.offload is not None:
            for req in reversed(self.offload.take_loaded()):  # their KV is in place now
                self.waiting.add(req, front=True)
        budget = self.config.max_num_batched_tokens
        max_model_len = self.config.max_model_len
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        # Bound once: this loop runs per request per step.
        allocate_slots, running = self.kv.allocate_slots, self.running
        # KVCacheManager.idle_until: calls it may skip (every running request has an entry)
        idle_until = self.kv.idle_until
        unannounced = self._unannounced
        cached_ids, cached_blocks = cached.req_ids, cached.new_block_ids
        cached_computed = cached.num_computed_tokens
        lookahead = self.num_lookahead_tokens
        long_prefill = self.config.long_prefill_token_threshold  # a request's most a step
        spec_tokens: dict[str, list[int]] = {}

        # 1. Running requests, in order; preempt from the back when the cache is full
        #    (_preempt removes from `running` in place). The victim is never a request
        #    scheduled earlier in this loop, so each is advanced (optimistically: the runner
        #    computes exactly what was granted) as soon as it is scheduled.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_computed = req.num_computed_tokens
            # Tokens not yet computed (a decode step: 1; in-flight ones count, async_scheduling.py),
            # capped by the context length and the budget (compared: runs per request per step).
            wanted = len(req.all_token_ids) + len(req.spec_token_ids) + req.num_output_placeholders
            if req.num_output_placeholders and past_last_token(req, wanted, max_model_len):
                wanted = num_computed  # its in-flight token is its last: no wasted step
            if wanted > max_model_len:
                wanted = max_model_len
            num_new = wanted - num_computed
            if num_new > budget:
                num_new = budget
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            if num_new <= 0:
                i += 1
                continue
            req_id = req.request_id
            if req.spec_token_ids:  # the drafts that fit (budget, max_model_len)
                num_drafts = num_computed + num_new - len(req.all_token_ids)
                if num_drafts > 0:
                    spec_tokens[req_id] = req.spec_token_ids[:num_drafts]
            if (
                num_computed + num_new + lookahead <= idle_until[req_id]
                and req_id not in unannounced
            ):
                # Most decode steps: the manager has nothing to do
                cached_ids.append(req_id)
                cached_blocks.append(None)
                cached_computed.append(num_computed)
                num_scheduled[req_id] = num_new
                req.num_computed_tokens = num_computed + num_new
                budget -= num_new
                i += 1
                continue
            new_blocks = allocate_slots(req, num_new + lookahead, num_computed)
            while new_blocks is None:
                victim = self._pick_victim()
                if victim is req and i == 0:
                    # Alone, with every other block free or evictable: it can never fit.
                    self._finish_unfittable(req)
                    break
                self._preempt(victim)
                preempted.add(victim.request_id)
                spec_tokens.pop(victim.request_id, None)
                if victim is req:
                    break
                new_blocks = allocate_slots(req, num_new + lookahead, num_computed)
            if new_blocks is None:
                if req.is_finished:
                    continue  # removed from running: `i` is the next request already
                break  # req itself was preempted: everything after it already was
            if unannounced and req_id in unannounced:
                # admitted with its KV in place: the runner sees it for the first time
                unannounced.discard(req_id)
                new_reqs.append(self._new_request_data(req, self.kv.get_block_ids(req)))
            else:
                block_ids = new_blocks.block_ids
                cached_ids.append(req_id)
                # None, not five empty lists, when no group got a block (most decode steps)
                cached_blocks.append(tuple(map(list, block_ids)) if any(block_ids) else None)
                cached_computed.append(num_computed)
            num_scheduled[req_id] = num_new
            req.num_computed_tokens = num_computed + num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, unless this step had to preempt (the cache is tight).
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                break  # admitted by the KV connector (P/D), not here
            if req.sampling_params.prompt_logprobs is not None and not req.output_token_ids:
                # It needs the logits of every prompt position: compute the whole prompt
                # (vLLM does the same). A resumed request got its prompt logprobs already.
                num_hit, hit = 0, None
            else:
                num_hit, hit = self.kv.get_computed_blocks(req)
                if self.offload is not None:
                    start = self.offload.start_load(req, num_hit)
                    if start is LoadStart.STARTED:
                        self.waiting.pop()  # parked until take_loaded() returns it
                        continue
                    if start is LoadStart.NO_ROOM and (self.running or self.offload.num_loading):
                        break  # loading beats recomputing: wait for blocks to free up
            num_new = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            new_blocks = self.kv.allocate_slots(req, num_new + lookahead, num_hit, hit)
            if new_blocks is None:
                loading = self.offload is not None and self.offload.num_loading
                if not self.running and not loading:  # all free or evictable: never fits
                    self.waiting.pop()
                    self._finish_unfittable(req)
                    continue
                break
            self.waiting.pop()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self._add_running(req)
            new_reqs.append(
                self._new_request_data(req, tuple(list(b) for b in new_blocks.block_ids))
            )
            num_scheduled[req.request_id] = num_new
            req.num_computed_tokens += num_new
            budget -= num_new

        out = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        return out

    @staticmethod
    def _new_request_data(req: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return NewRequestData(
            req.request_id,
            list(req.all_token_ids),
            req.num_prompt_tokens,
            req.sampling_params,
            block_ids,
            req.num_computed_tokens,
        )

    def _pick_victim(self) -> Request:
        """The request that would be scheduled last: the least urgent under the priority
        policy. Requests are scheduled front to back, so it is either the one asking for
        blocks or one not scheduled yet this step, never one already in this step's batch."""
        return self.running[-1]

    def _finish_unfittable(self, req: Request) -> None:
        """Finish (length) a request that needs more KV than the whole cache holds, rather
        than let it wait forever at the head of the queue. EngineCore refuses to start when
        one max_model_len request cannot fit, so this only guards other set-ups."""
        logger.warning(
            "request %s needs KV for %d tokens, more than the whole cache holds: finished "
            "with reason 'length' (raise --kv-cache-memory or lower --max-model-len)",
            req.request_id,
            req.num_computed_tokens or req.num_tokens,
        )
        if req in self.running:
            self.running.remove(req)
        self._free(req, RequestStatus.FINISHED_LENGTH_CAPPED)
        self._finished_outputs.append(
            EngineCoreOutput(
                request_id=req.request_id,
                new_token_ids=[],
                finish_reason=RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason.value,
                num_cached_tokens=req.num_cached_tokens,
            )
        )

    def _preempt(self, req: Request) -> None:
        """Recompute later: free every block; a prefix hit may restore part of it."""
        self.running.remove(req)
        self._unannounced.discard(req.request_id)  # recomputed: announced when re-admitted
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=True)
