"""The KV connector of one engine: P/D roles between the engine loop and the transports.

Prefill side (producer, ``prefill_side.py``), on the loop::

    request with do_remote_decode --> the whole prompt, max_tokens 1: its token t1 goes back
    in the answer (the decode side emits it on arrival). The decode side takes the KV of
    N tokens, or of N-1 when it computes the last prompt token again (t1 not carried: n > 1,
    a pull sent before the answer; or a drafter, whose rows need that step), so commits
    stop one token short (``Request.kv_commit_lag``): the windows of both stay in the
    table. The KVStore entry opens under transfer_key(transfer_id, prompt[:N-1])
    each step while it prefills (tcp, nccl), once a streaming pull waits on it --> the rows of
    every block whose positions are all computed (every group: compressed pages, the
    sliding-window and compressor-state pages the decode side will hold, the MTP layer's
    rows in "swa") join the entry as a Piece; the pull sends them while the next chunks
    compute
    finished --> blocks freed at once; the rest (ExportedRows, the tail) is copied out after
    the step's outputs are sent (``export_finished``: t1's answer never waits on a gather
    per layer), before anything can reuse those blocks

Decode side (consumer), each step (``step``), never waiting on a transfer::

    add: request WAITING_FOR_REMOTE_KV, held here (not in the scheduler's queue); a t1
        carried in its kv_transfer_params is emitted now (Scheduler.take_first_tokens)
    admit (<= max_kv_loads_per_step a step): prefix lookup, blocks reserved for [0, N) with
        t1 here ([0, N-1) without), only the slots the hit lacks are asked for; the pull
        runs on a transfer thread
    land (<= max_kv_loads_per_step a step): region written into the reserved blocks, the
        request joins the running batch with N (N-1) tokens computed: its next step
        computes t1 (the last prompt token)
    failure (peer gone, lease over, checksum, unknown key): blocks freed, then the request
        recomputes its prompt (policy recompute) or ends with an error (policy fail)

Prefix hits cover whole blocks: positions ::

    [0 ........ B)[B ................ N-1)[N-1][t1]
     local hit     pulled from prefill     |    computed here
                                           pulled with t1 here, else computed here
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import msgspec
import torch

from rackserve.config import DisaggConfig
from rackserve.disagg.prefill_side import PrefillSide
from rackserve.disagg.store import KVStore
from rackserve.disagg.transports import (
    Fault,
    FetchJob,
    KVClient,
    KVServer,
    TransferError,
)
from rackserve.disagg.wire import transfer_key
from rackserve.engine.outputs import EngineCoreRequest, Logprob
from rackserve.engine.scheduler import Scheduler
from rackserve.model.batch import KVCacheTensors
from rackserve.request import CarriedLogprob, KVTransferParams, Request, RequestStatus
from rackserve.runner.kv_transfer import NULL_BLOCK_ID, import_blocks, packed_numel

logger = logging.getLogger(__name__)
MAX_TRANSFER_THREADS = 8
IDLE_WAIT_S = 0.005  # an engine with only remote-KV requests naps this long per step


@dataclass
class RemoteKV:
    """A decode-side request whose prompt KV comes from a prefill engine."""

    request: Request
    params: KVTransferParams
    key: str
    num_tokens: int  # tokens whose KV is pulled (or hit locally): N-1, or N with t1 here
    num_hit: int = 0
    block_ids: tuple[list[int], ...] = ()  # receiver ids of the slots asked for, per group
    future: Future | None = None
    started: float = field(default_factory=time.monotonic)


@dataclass
class StepRecord:
    """What the connector did in one step (tests assert the admission cap on these)."""

    num_admitted: int = 0  # transfers started
    num_loaded: int = 0  # requests moved to running with their KV in place
    num_failed: int = 0


class KVConnector:
    def __init__(
        self,
        config: DisaggConfig,
        scheduler: Scheduler,
        caches: KVCacheTensors,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.caches = caches
        self.dtype = dtype
        self.device = device
        self.transport = config.kv_connector
        if self.transport == "nixl":
            from rackserve.disagg.nixl import check_nixl

            check_nixl()  # ConfigError naming the fix when the package is missing
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = config.kv_connector_extra_config
        self.prefill: PrefillSide | None = None
        if config.is_producer:
            fault = Fault.parse(extra.get("inject_fault"))
            self.prefill = PrefillSide(config, scheduler, caches, fault, backend)
        # (layers, elements per slot per layer) of each group: a streamed pull's layout
        self.layout = tuple(
            (len(caches.tensors[name]), next(iter(caches.tensors[name].values()))[0].numel())
            for name in caches.groups
        )
        self.client: KVClient | None = None
        self._pool: ThreadPoolExecutor | None = None
        if config.is_consumer:
            self.client = KVClient(self.transport, config.lease_s, config.kv_ip, backend)
            self._pool = ThreadPoolExecutor(MAX_TRANSFER_THREADS, thread_name_prefix="kv-pull")
        self.pending: deque[RemoteKV] = deque()  # not admitted yet (no room, or over the cap)
        self.inflight: dict[str, RemoteKV] = {}  # admitted: blocks reserved, pull running
        self._landed = threading.Event()  # a pull finished: wakes a napping loop
        self.errors: list[tuple[str, str]] = []  # (request id, message) for policy "fail"
        self.records: list[StepRecord] = []
        self.num_bytes_received = 0
        self.num_blocks_received = [0] * len(caches.groups)  # per cache group
        self.num_loads = self.num_failures = 0
        self._last_heartbeat = time.monotonic()

    # ---- both sides: requests in ----------------------------------------------------------
    def prepare(self, request: EngineCoreRequest) -> EngineCoreRequest | None:
        """A prefill request rewritten (one token); None when ``request`` is a decode-side
        one the connector takes (``add_remote``)."""
        params = request.sampling_params.kv_transfer_params
        if params is None or not (params.do_remote_decode or params.do_remote_prefill):
            return request
        if params.do_remote_decode:
            if not self.config.is_producer:
                raise ValueError("do_remote_decode: this engine is not a kv_producer")
            # min_tokens 1 keeps EOS masked for t1 as the aggregated engine would
            min_tokens = min(request.sampling_params.min_tokens, 1)
            sampling = replace(request.sampling_params, max_tokens=1, min_tokens=min_tokens, n=1)
            if len(request.prompt_token_ids) < 2:  # nothing to send: decode computes it all
                sampling = replace(sampling, kv_transfer_params=None)
            elif self.prefill is not None:
                self.prefill.open(request, params)
            return msgspec.structs.replace(request, sampling_params=sampling)
        if not self.config.is_consumer:
            raise ValueError("do_remote_prefill: this engine is not a kv_consumer")
        return None

    def add_remote(self, req: Request) -> None:
        """Hold a decode-side request until its KV has landed (or recompute it at once when
        there is nothing to pull)."""
        params = req.sampling_params.kv_transfer_params
        assert params is not None
        num_tokens = req.num_prompt_tokens - 1
        if num_tokens < 1 or req.sampling_params.prompt_logprobs is not None:
            # Nothing to pull, or every prompt position's logits are wanted: compute here
            # (the prompt logprobs go out with the first token this engine samples).
            self.scheduler.add_request(req)
            if req.sampling_params.prompt_logprobs is None:
                self._take_first(req, params.first_token_ids, params.first_logprobs)
            return
        self.scheduler.add_waiting_for_kv(req)
        key = transfer_key(params.transfer_id, req.prompt_token_ids[:num_tokens])
        req.num_cached_tokens = params.num_cached_tokens
        if self._take_first(req, params.first_token_ids, params.first_logprobs):
            return  # t1 ended it (EOS, a stop token, max_tokens 1): nothing to pull
        if req.output_token_ids and not self.scheduler.num_lookahead_tokens:
            # t1 is here: the KV of the whole prompt comes (the prefill side holds both
            # windows), and t1's step is a plain decode step, a CUDA-graph one. A drafter
            # would also need the rows t1 wrote there (the MTP row N), so speculating, the
            # last prompt token is computed here again.
            num_tokens += 1
        self.pending.append(RemoteKV(req, params, key, num_tokens))

    def _take_first(
        self,
        req: Request,
        token_ids: tuple[int, ...] | list[int],
        logprobs: tuple[CarriedLogprob, ...] | None,
    ) -> bool:
        """Emit the prefill side's t1 as ``req``'s first token (once; only for n = 1: each
        of n > 1 samples its own). True when that finished the request."""
        if not token_ids or req.output_token_ids:
            return False
        entries = None
        if req.sampling_params.logprobs is not None:
            if logprobs is None:  # asked for, not carried: the decode side computes t1
                return False
            entries = [Logprob(list(ids), list(values), rank) for ids, values, rank in logprobs]
        return self.scheduler.take_first_tokens(req, list(token_ids), entries)

    # ---- prefill side (disagg/prefill_side.py) ----------------------------------------------
    @property
    def store(self) -> KVStore | None:
        """The producer's store (its peers pull from it)."""
        return self.prefill.store if self.prefill is not None else None

    @property
    def server(self) -> KVServer | None:
        return self.prefill.server if self.prefill is not None else None

    @property
    def has_pending_exports(self) -> bool:
        return self.prefill is not None and self.prefill.has_pending_exports

    def export_finished(self) -> None:
        """The finished prefills' KV into the store (``PrefillSide.export_finished``)."""
        if self.prefill is not None:
            self.prefill.export_finished()

    # ---- decode side: one step -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.pending) + len(self.inflight)

    def step(self) -> StepRecord:
        """Land finished pulls, then admit waiting requests; both under the cap."""
        record = StepRecord()
        if self.prefill is not None:
            self.prefill.stream_blocks()
        if self.client is None:
            return record
        cap = self.config.max_kv_loads_per_step or len(self.inflight) + len(self.pending)
        self._land(record, cap)
        self._admit(record, cap)
        self._heartbeat()
        if record.num_admitted or record.num_loaded or record.num_failed:
            self.records.append(record)
        return record

    def wait(self) -> None:
        """Nap (until a pull lands, at most IDLE_WAIT_S) when only remote-KV requests exist."""
        if self.inflight and not self.scheduler.running and not self.scheduler.waiting:
            self._landed.wait(IDLE_WAIT_S)
        self._landed.clear()

    def _alive(self, remote: RemoteKV) -> bool:
        req = remote.request
        return (
            self.scheduler.requests.get(req.request_id) is req
            and req.status == RequestStatus.WAITING_FOR_REMOTE_KV
        )

    def _land(self, record: StepRecord, cap: int) -> None:
        for req_id, remote in list(self.inflight.items()):
            if not self._alive(remote):  # aborted meanwhile: its blocks are already freed
                del self.inflight[req_id]
                if self.client is not None:
                    self.client.remote_ends.pop(remote.key, None)
                continue
            if remote.future is None or not remote.future.done():
                continue
            del self.inflight[req_id]
            try:
                region = remote.future.result()
                import_blocks(self.caches, remote.block_ids, region)
            except (TransferError, ValueError) as e:
                self._fail(remote, str(e))
                record.num_failed += 1
                continue
            # the prefill side's hit, when the pull went out before its answer (router overlap)
            end = self.client.remote_ends.pop(remote.key, None) if self.client else None
            req = remote.request
            if end is not None:
                req.num_cached_tokens = max(req.num_cached_tokens, end.num_cached_tokens)
            self.num_bytes_received += region.numel() * region.element_size()
            for g, ids in enumerate(remote.block_ids):
                self.num_blocks_received[g] += len(ids)
            self.scheduler.run_with_kv(req, remote.num_tokens)
            self.num_loads += 1
            record.num_loaded += 1
            if record.num_loaded >= cap:
                break

    def _admit(self, record: StepRecord, cap: int) -> None:
        sched = self.scheduler
        while self.pending and record.num_admitted < cap:
            remote = self.pending[0]
            if not self._alive(remote):
                self.pending.popleft()
                continue
            if len(sched.running) + len(self.inflight) >= sched.config.max_num_seqs:
                return
            req = remote.request
            num_hit, hit = sched.kv.get_computed_blocks(req)
            if num_hit >= remote.num_tokens:  # all here already: an ordinary request
                self.pending.popleft()
                sched.requeue(req)
                continue
            budget = sched.config.max_num_batched_tokens
            if not sched.kv.reserve(req, remote.num_tokens, budget, hit if num_hit else None):
                return  # no room now: retry next step (the producer's lease is heartbeated)
            self.pending.popleft()
            remote.num_hit = num_hit
            req.num_cached_tokens = max(req.num_cached_tokens, num_hit)
            slots, block_ids = self._needed_slots(req, hit.blocks if num_hit else None)
            remote.block_ids = block_ids
            job = FetchJob(
                remote.params.remote_host or "",
                remote.params.remote_port or 0,
                remote.key,
                slots,
                packed_numel(self.caches, block_ids),
                self.dtype,
                self.device,
                self.layout,
            )
            assert self._pool is not None and self.client is not None
            remote.future = self._pool.submit(self.client.fetch, job)
            remote.future.add_done_callback(lambda _: self._landed.set())
            self.inflight[req.request_id] = remote
            record.num_admitted += 1

    def _needed_slots(
        self, req: Request, hit_blocks: tuple | None
    ) -> tuple[list[list[int]], tuple[list[int], ...]]:
        """Per group, the table slots to fill (live, not from the hit) and their block ids."""
        tables = self.scheduler.kv.get_block_ids(req)
        slots, ids = [], []
        for g, table in enumerate(tables):
            have = {b.block_id for b in hit_blocks[g]} if hit_blocks is not None else set()
            wanted = [i for i, b in enumerate(table) if b != NULL_BLOCK_ID and b not in have]
            slots.append(wanted)
            ids.append([table[i] for i in wanted])
        return slots, tuple(ids)

    def _fail(self, remote: RemoteKV, message: str) -> None:
        req = remote.request
        self.num_failures += 1
        logger.warning("KV transfer for %s failed: %s", req.request_id, message)
        if self.config.kv_load_failure_policy == "recompute":
            self.scheduler.requeue(req)  # frees the reserved blocks; recomputes the prompt
            return
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
        message = f"KV transfer from the prefill engine failed: {message}"
        self.errors.append((req.request_id, message))

    def _heartbeat(self) -> None:
        """Every lease/3, extend the producer's copies of requests not pulled yet; a copy
        already gone fails its request now rather than at the pull."""
        now = time.monotonic()
        if now - self._last_heartbeat < self.config.lease_s / 3 or not self.pending:
            return
        self._last_heartbeat = now
        by_peer: dict[tuple[str, int], list[RemoteKV]] = {}
        for remote in self.pending:
            peer = (remote.params.remote_host or "", remote.params.remote_port or 0)
            by_peer.setdefault(peer, []).append(remote)
        assert self._pool is not None and self.client is not None
        for (host, port), remotes in by_peer.items():
            keys = [r.key for r in remotes]
            self._pool.submit(self._heartbeat_one, host, port, keys)

    def _heartbeat_one(self, host: str, port: int, keys: list[str]) -> None:
        assert self.client is not None
        try:
            self.client.heartbeat(host, port, keys)
        except (TransferError, OSError) as e:  # the pull will fail and apply the policy
            logger.info("KV heartbeat to %s:%d failed: %s", host, port, e)

    def take_errors(self) -> list[tuple[str, str]]:
        errors, self.errors = self.errors, []
        return errors

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
