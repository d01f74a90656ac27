"""The scheduler's state and its requests in and out (``SchedulerRequests``, the base of
``engine/scheduler.py``'s ``Scheduler``).

The constructor (every field the step code reads), admission (the queue, a structured-output
request waiting for its grammar, a request admitted with its KV already in place: P/D decode
side and ``bench decode``), requeueing, finishing and aborting (freeing blocks at once), the
running list's order, and the outputs made outside a step, which the next ``update`` reports.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from rackserve.config import SchedulerConfig
from rackserve.engine.outputs import EngineCoreOutput
from rackserve.engine.request_queue import WaitingQueue
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.offload import KVOffloader
from rackserve.request import Request, RequestStatus
from rackserve.runner.structured_output import GrammarWait
from rackserve.spec_decode.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


def _urgency(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time  # lower runs first, as in vLLM


class SchedulerRequests:
    """The state of :class:`rackserve.engine.scheduler.Scheduler` and the methods that
    bring requests in and take them out; planning and updating a step are its subclasses'."""

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

    def _add_running(self, req: Request) -> None:
        if self.waiting.priority:  # after its equals: FCFS among the same urgency
            bisect.insort(self.running, req, key=_urgency)
        else:
            self.running.append(req)
