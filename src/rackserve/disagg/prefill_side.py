"""The producer's half of the KV connector (``connector.py``): the store its decode peers
pull from, the pieces streamed while a prompt prefills, and the copy of a finished
request's KV.

Per request with ``do_remote_decode`` (``open``, from ``KVConnector.prepare``): its store
entry opens under transfer_key(transfer_id, prompt[:N-1]). While it prefills (tcp, nccl),
once a streaming pull waits on the entry, each step's start adds the rows of every block
whose positions are all computed (``stream_blocks``). When it finishes, the scheduler frees
its blocks at once (``request_finished``) and the rest is copied out after the step's
outputs are sent (``export_finished``), before anything can write those blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rackserve.config import DisaggConfig
from rackserve.disagg.store import KVStore, Piece
from rackserve.disagg.transports import STREAMING_TRANSPORTS, Fault, KVServer
from rackserve.disagg.wire import transfer_key
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.engine.scheduler import Scheduler
from rackserve.model.batch import KVCacheTensors
from rackserve.request import KVTransferParams, Request, RequestStatus
from rackserve.runner.kv_transfer import NULL_BLOCK_ID, ExportedRows, device_index

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class _Prefill:
    """A request prefilling now whose finished blocks stream out (``stream_blocks``)."""

    key: str
    sent: list[set[int]]  # per group, the table slots already added as pieces


@dataclass(frozen=True)
class _Export:
    """A finished prefill whose rows are copied out once its output is sent: ``block_ids``
    are freed already, and untouched until the next ``schedule()`` or KV import."""

    key: str
    block_ids: tuple[list[int], ...]
    num_consumers: int
    num_cached_tokens: int


class PrefillSide:
    def __init__(
        self,
        config: DisaggConfig,
        scheduler: Scheduler,
        caches: KVCacheTensors,
        fault: Fault,
        backend: str,
    ) -> None:
        self.scheduler = scheduler
        self.caches = caches
        self.store = KVStore(config.lease_s)
        self.server = KVServer(self.store, config.kv_ip, config.kv_port, fault, backend)
        scheduler.on_finish = self.request_finished
        self.prefills: dict[str, _Prefill] = {}  # requests prefilling now
        self.exports: deque[_Export] = deque()  # finished, rows not copied yet
        # blocks stream out during the prefill on the stream transports (the others pull
        # the whole region at the end); every group must have its spec for the block rule
        self.streaming = config.kv_connector in STREAMING_TRANSPORTS and len(
            scheduler.kv.specs
        ) == len(caches.groups)

    def open(self, request: EngineCoreRequest, params: KVTransferParams) -> None:
        """The store entry of a request about to prefill for a decode peer."""
        key = transfer_key(params.transfer_id, request.prompt_token_ids[:-1])
        self.export_finished()  # the store sees its changes in the order they came
        self.store.open(key, params.num_consumers)
        groups = [set[int]() for _ in self.caches.groups]
        self.prefills[request.request_id] = _Prefill(key, groups)

    def request_finished(self, req: Request, block_ids: tuple[list[int], ...]) -> None:
        """Scheduler hook before a request's blocks are freed: a copy for the pulls is due
        (``export_finished``; its open store entry keeps pulls waiting meanwhile)."""
        params = req.sampling_params.kv_transfer_params
        if params is None or not params.do_remote_decode:
            return
        prefill = self.prefills.pop(req.request_id, None)
        if prefill is not None:  # the key open made (hashing the prompt again: O(prompt))
            key = prefill.key
        else:
            key = transfer_key(params.transfer_id, req.prompt_token_ids[:-1])
        if req.status not in _COMPLETED:
            self.export_finished()
            self.store.discard(key)  # aborted: a waiting pull fails now
            return
        self.exports.append(_Export(key, block_ids, params.num_consumers, req.num_cached_tokens))

    @property
    def has_pending_exports(self) -> bool:
        return bool(self.exports)

    def export_finished(self) -> None:
        """Copy the rows of the prefills finished since the last call into the store (a
        gather per cache tensor: on a GPU, launches per layer). Called once their outputs
        are sent (``EngineCore.flush_kv_exports``) and before anything can write the freed
        blocks or change the store: each step's start, after ``schedule()`` (a request it
        finished), before a KV import (``add_request_with_kv``), an open or a discard."""
        while self.exports:
            export = self.exports.popleft()
            rows = ExportedRows(self.caches, export.block_ids)
            self.store.put(export.key, rows, export.num_consumers, export.num_cached_tokens)

    def stream_blocks(self) -> None:
        """At the start of a step (the previous step's chunk is computed, or, on a GPU,
        queued before any copy made here): the rows of newly finished blocks join the
        request's store entry. A block of group g at slot i is finished when its positions
        [i*T, (i+1)*T) lie below L - 1 (L computed tokens; the MTP layer writes row p + 1
        with position p's chunk, hence the one spare position). Sliding and state groups
        send only the slots still live when the prompt ends (the decode side holds no
        others)."""
        if not self.prefills or not self.streaming:
            return
        sched, specs = self.scheduler, self.scheduler.kv.specs
        for req_id, prefill in list(self.prefills.items()):
            req = sched.requests.get(req_id)
            if req is None:  # refused when it was added: nothing will come
                del self.prefills[req_id]
                self.store.discard(prefill.key)
                continue
            done = req.num_computed_tokens - 1
            if req.status != RequestStatus.RUNNING or done <= 0:
                continue
            if not self.store.is_watched(prefill.key):  # nobody pulls yet: the tail sends all
                continue
            tables = sched.kv.get_block_ids(req)
            for g, (spec, name, table) in enumerate(
                zip(specs, self.caches.groups, tables, strict=True)
            ):
                # the decode side holds the window of N-1 tokens (it computes token N-1)
                first = spec.first_live_slot(req.num_prompt_tokens - 1) if spec.is_sliding else 0
                last = min(done // spec.block_tokens, len(table))
                sent = prefill.sent[g]
                new = [i for i in range(first, last) if i not in sent and table[i] != NULL_BLOCK_ID]
                if not new:
                    continue
                tensors = list(self.caches.tensors[name].values())
                index = device_index([table[i] for i in new], tensors)
                rows = [t.index_select(0, index.to(t.device)) for t in tensors]
                self.store.add_piece(prefill.key, Piece(g, new, rows))
                sent.update(new)

    def close(self) -> None:
        self.exports.clear()
        self.server.close()
        self.store.clear()
