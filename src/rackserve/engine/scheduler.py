"""The phase-free scheduler: each step grants tokens to requests under a token budget.

A request only has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens``; a
prefill chunk, a decode step and a recompute after preemption are the same thing: "compute
the next ``n`` tokens". Running requests are served first (in order), then waiting ones
(FCFS or priority). When the cache is full the scheduler preempts (recompute) the running
request that would be scheduled last; the KV manager never decides policy.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from rackserve.config import SchedulerConfig
from rackserve.engine.async_scheduling import past_last_token
from rackserve.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    Logprob,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from rackserve.engine.request_queue import WaitingQueue
from rackserve.engine.stop import StopDecision, check_stop_tokens
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.offload import KVOffloader, LoadStart
from rackserve.request import Request, RequestStatus
from rackserve.runner.structured_output import GrammarWait
from rackserve.spec_decode.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


def _stopped(req: Request, out: EngineCoreOutput, decision: StopDecision) -> RequestStatus:
    """The finished status a stop decision gives; its reasons go on ``out`` and ``req``."""
    status = (
        RequestStatus.FINISHED_STOPPED
        if decision.kind == "stop"
        else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    out.finish_reason = status.finish_reason.value
    out.stop_reason = req.stop_reason = decision.stop_reason
    return status


def _urgency(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time  # lower runs first, as in vLLM


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        eos_token_ids: tuple[int, ...],
        offload: KVOffloader | None = None,
        num_spec_tokens: int = 0,
    ) -> None:
        """``num_spec_tokens`` K > 0: speculative decoding. A request with drafts
        (``Request.spec_token_ids``, from the runner) is granted them too, and every
        allocation reserves K lookahead positions past the step for the drafter's chain."""
        self.config = config
        self.num_lookahead_tokens = num_spec_tokens
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.kv = kv_manager
        # The host KV pool: a request whose prefix hit grows with it waits outside the queue
        # (WAITING_FOR_POOL_KV) while its blocks load.
        self.offload = offload
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        # Served in order; under the priority policy kept sorted by urgency, so that, as in
        # FCFS, the request to preempt is always the last one (not yet scheduled this step).
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # told to the runner with the next step
        self._unannounced: set[str] = set()  # admitted with KV, not yet sent to the runner
        # Finished by schedule() (they can never fit): reported by the next update().
        self._finished_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.waiting_for_grammar = GrammarWait()  # WAITING_FOR_FSM: not in `waiting` yet
        # P/D prefill side (disagg/connector.py): sees a finished request's block tables
        # before they are freed; it copies the KV out of them for the decode side after the
        # step's outputs are sent, before any forward or import can reuse them.
        self.on_finish: Callable[[Request, tuple[list[int], ...]], None] | None = None

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(
        self, req: Request, grammar: Future | None = None, grammar_timeout_s: float = 30.0
    ) -> None:
        """Queue a request. One whose structured-output ``grammar`` is still compiling
        waits outside the queue (WAITING_FOR_FSM) until it compiles, or fails alone after
        ``grammar_timeout_s``: other requests keep stepping meanwhile."""
        self._check_new(req)
        self.requests[req.request_id] = req
        if grammar is not None and not grammar.done():
            req.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_grammar.add(req, grammar, grammar_timeout_s)
        else:
            self.waiting.add(req)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar compiled; fail those whose compile failed or
        timed out (reported, with the reason, by the next update())."""
        ready, failed = self.waiting_for_grammar.poll()
        for req in ready:
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
        for req, message in failed:
            logger.warning("request %s: %s", req.request_id, message)
            self._free(req, RequestStatus.FINISHED_ABORTED)
            self._finished_outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[],
                    finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason.value,
                    error=message,
                )
            )

    def _check_new(self, req: Request) -> None:
        """Bad input (the client's fault) raises ValueError and changes nothing."""
        limit = self.config.max_model_len
        if req.num_prompt_tokens >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{req.num_prompt_tokens} tokens (at least one must be left to generate)"
            )
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")

    def add_request_with_kv(self, req: Request, num_computed_tokens: int) -> bool:
        """Admit a request whose first ``num_computed_tokens`` tokens get their KV written
        straight into its blocks, with no prefill here: the P/D decode side (the prefill
        instance pushes the KV) and ``bench decode`` (synthetic contexts). Allocates the
        blocks now, a token budget at a time as a prefill would; returns False, changing
        nothing, when the batch is full or the cache lacks room."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if not 0 < num_computed_tokens < req.num_tokens:
            raise ValueError("num_computed_tokens must leave at least one token to compute")
        self._check_new(req)
        # Nothing is cached before a step has run on the KV (KVCacheManager.reserve): a
        # request with the same prefix must not hit blocks the transfer has not filled.
        budget = self.config.max_num_batched_tokens
        if not self.kv.reserve(req, num_computed_tokens, budget):
            return False
        self.requests[req.request_id] = req
        self.run_with_kv(req, num_computed_tokens)
        return True

    # ---- P/D decode side (disagg/connector.py holds the request meanwhile) -----------------
    def add_waiting_for_kv(self, req: Request) -> None:
        """Register a request whose prompt KV will be pulled; the connector reserves its
        blocks (``kv.reserve``) and calls :meth:`run_with_kv` once the KV has landed."""
        self._check_new(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req

    def run_with_kv(self, req: Request, num_computed_tokens: int) -> None:
        """Its blocks hold the KV of its first ``num_computed_tokens`` tokens: run it."""
        req.num_computed_tokens = num_computed_tokens
        req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self._add_running(req)
        self._unannounced.add(req.request_id)

    def take_first_tokens(
        self, req: Request, token_ids: list[int], logprobs: list[Logprob] | None
    ) -> bool:
        """P/D decode side: the tokens the prefill engine sampled after the prompt become
        ``req``'s first output, sent with the next step's outputs as if a step had sampled
        them (stop checks included). True when they finished it (its blocks are freed)."""
        params, num_output = req.sampling_params, len(req.output_token_ids)
        if num_output or not token_ids:
            return False
        decision, max_model_len = None, self.config.max_model_len
        stop = check_stop_tokens(
            params, token_ids, num_output, self.eos_token_ids, req.num_tokens, max_model_len
        )
        if stop is not None:
            num_kept, decision = stop
            token_ids = token_ids[:num_kept]
        req.append_output_token_ids(token_ids)
        out = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=list(token_ids),
            num_cached_tokens=req.num_cached_tokens,
            first_scheduled_time=time.monotonic(),
        )
        if logprobs is not None:
            out.new_logprobs = logprobs[: len(token_ids)]
        self._finished_outputs.append(out)
        if decision is None:
            return False
        self.finish_requests([req.request_id], _stopped(req, out, decision))
        return True

    def requeue(self, req: Request) -> None:
        """Compute it here after all (its KV transfer failed, or its prefix is cached):
        blocks reserved for the transfer are freed, unkeyed; it waits like a new request."""
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; frees their blocks at once."""
        reqs = [self.requests[i] for i in request_ids if i in self.requests]
        if not reqs:
            return []
        ids = {r.request_id for r in reqs}
        self.waiting.remove(ids)
        for req_id in ids:
            self.waiting_for_grammar.discard(req_id)
        self.running = [r for r in self.running if r.request_id not in ids]
        for req in reqs:
            self._free(req, status)
        return reqs

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if self.on_finish is not None:
            self.on_finish(req, self.kv.get_block_ids(req))
        self._unannounced.discard(req.request_id)
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_outputs(self) -> bool:
        """Outputs made outside a step wait for the next :meth:`update` (or
        :meth:`take_outputs`)."""
        return bool(self._finished_outputs)

    def take_outputs(self) -> list[EngineCoreOutput]:
        """The outputs made outside a step so far (a P/D request's first token)."""
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

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

    def _add_running(self, req: Request) -> None:
        if self.waiting.priority:  # after its equals: FCFS among the same urgency
            bisect.insort(self.running, req, key=_urgency)
        else:
            self.running.append(req)

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

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Apply sampled tokens, finish requests, commit computed KV to the cache."""
        outputs, self._finished_outputs = self._finished_outputs, []
        finished = set()
        # Hoisted: this loop runs once per request per step.
        get_request, commit, running = self.requests.get, self.kv.commit, RequestStatus.RUNNING
        idle_until = self.kv.idle_until  # every running request has an entry
        eos_token_ids, max_model_len = self.eos_token_ids, self.config.max_model_len
        eos_set = frozenset(eos_token_ids)
        all_logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        spec_tokens, new_drafts = sched.scheduled_spec_decode_tokens, result.draft_token_ids
        speculating = self.num_lookahead_tokens > 0
        for k, (req_id, sampled) in enumerate(
            zip(result.req_ids, result.sampled_token_ids, strict=True)
        ):
            req = get_request(req_id)
            if req is None or req.status != running:
                continue  # aborted or preempted while the step ran
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts:
                # rejected drafts were never computed, as far as the cache is concerned: the
                # commit below (after the accepted tokens are appended) keys only verified ones
                req.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                self._observe_drafts(len(drafts), len(sampled) - 1)
            elif req.num_computed_tokens >= idle_until[req_id]:  # else a no-op
                commit(req, req.num_computed_tokens - req.kv_commit_lag)
            if not sampled:
                continue  # a prefill chunk short of the prompt's end
            params = req.sampling_params
            decision = None
            # Counts as if the tokens were appended one by one (the stop check sees each).
            num_output, num_tokens = len(req.output_token_ids), len(req.all_token_ids)
            num_accepted = len(sampled)
            # Counts only grow with j: when none of the tokens can stop the request (the
            # usual decode step), the per-token scan (check_stop_tokens) is skipped.
            if (
                num_output + num_accepted >= params.max_tokens
                or num_tokens + num_accepted >= max_model_len
                or not eos_set.isdisjoint(sampled)
                or (params.stop_token_ids and not set(params.stop_token_ids).isdisjoint(sampled))
            ):
                stop = check_stop_tokens(
                    params, sampled, num_output, eos_token_ids, num_tokens, max_model_len
                )
                if stop is not None:
                    num_accepted, decision = stop
            # The runner hands its lists over (as vLLM's does): no copy unless cut at a stop.
            accepted = sampled if num_accepted == len(sampled) else sampled[:num_accepted]
            req.append_output_token_ids(accepted)
            if drafts:  # cut at a stop: the tokens past it are not the request's
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                if req.num_computed_tokens >= idle_until[req_id]:
                    commit(req, req.num_computed_tokens)
            if speculating:
                req.spec_token_ids = new_drafts.get(req_id, [])
            out = EngineCoreOutput(
                request_id=req_id, new_token_ids=accepted, num_cached_tokens=req.num_cached_tokens
            )
            if len(req.output_token_ids) == num_accepted:  # its first tokens: when it started
                out.first_scheduled_time = req.first_scheduled_time
            if all_logprobs is not None and all_logprobs[k]:
                out.new_logprobs = [
                    Logprob(lp.token_ids, lp.logprobs, lp.rank)
                    for lp in all_logprobs[k][:num_accepted]
                ]
            if prompt_logprobs and req_id in prompt_logprobs and num_output == 0:
                out.prompt_logprobs = [
                    None if lp is None else Logprob(lp.token_ids, lp.logprobs, lp.rank)
                    for lp in prompt_logprobs[req_id]
                ]
            if decision is not None:
                finished.add(req_id)
                self._free(req, _stopped(req, out, decision))
            outputs.append(out)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return outputs

    def _observe_drafts(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert self.spec_stats is not None, "drafts were scheduled without num_spec_tokens"
        self.spec_stats.observe(num_draft_tokens, num_accepted)

    def stats(self) -> SchedulerStats:
        kv_stats = self.kv.stats
        return SchedulerStats(
            spec_decoding=None if self.spec_stats is None else self.spec_stats.copy(),
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting)
            + len(self.waiting_for_grammar)
            + (self.offload.num_loading if self.offload else 0),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=kv_stats.num_queried_tokens,
            prefix_cache_hits=kv_stats.num_hit_tokens,
            num_preemptions=self.num_preemptions,
        )
