"""CUDA graphs while speculating: the target's verify forward, the draft model's chain and
the MTP drafter's whole proposal.

Shape legend: B padded requests, K draft tokens, T = B (1 + K) verify tokens, N mHC
streams, D hidden, V vocabulary.

A uniform verify step (every request verifies exactly K drafts: 1 + K tokens, every one
sampled) replays a graph per (B, context bucket) of :class:`VerifyGraphs`; it returns the
logits of all T tokens and the final streams the MTP drafter reads. The draft model's K - 1
chained single-token steps replay :class:`DraftGraphs` (the first draft step, over the
kept tokens, stays eager). After a uniform verify step whose requests all draft greedily,
the MTP drafter's K steps (the first over each request's kept rows, padded to 1 + K, then
K - 1 chained ones) and their argmaxes replay one :class:`MTPGraphs` graph, and the draft
model's (the first step over each request's kept tokens and y, padded to 2 + K, then the
chain) one :class:`DraftProposalGraphs` graph: eager, such steps cost ~3 ms of host launches
each on the H200 (2026-12-01, ``bench decode --profile``). Their inputs are staged on the
device from the verify's (its inputs, sampled ids and the acceptance counted there), so the
proposal follows the verify on the stream; its drafts stay on the device, fed into the next
verify's input ids (``VerifyGraphs.run``'s ``feed``), and the host reads them back behind
that step. The host's work between two steps (their tokens' read-back, the scheduler, the
next step's inputs) thus runs while the device proposes, instead of ~2 ms a step with the
device idle (MTP K = 1 at 32 requests, H100, 2026-12-07).

Like ``runner/cuda_graph.DecodeGraphs`` (whose batch sizes and context buckets these
reuse), a graph reads static device buffers, derives every index
inside (``runner/cuda_graph.GraphMetadata``: every token a closing candidate and a token
mask; on a GPU the metadata kernels, else ``StepMetadata.build``), and pads with the null
block-table row, so padded requests write only the null block. A key
that was not captured runs the same padded step eagerly: the CPU tests check that path.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np
import torch

from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.cuda_graph import GraphMetadata, capture_region, frozen_gc
from rackserve.runner.inputs import StepInputs
from rackserve.runner.step_buffers import Feed, StaticInputs, StepBuffers, pad_to

Key = tuple[int, int]  # (padded requests B, context bucket)


class _GraphSet:
    """Graphs of one forward function per key, captured largest first into one pool."""

    def __init__(self, batch_sizes: Sequence[int], buckets: Sequence[int]) -> None:
        self.batch_sizes, self.buckets = sorted(batch_sizes), sorted(buckets)
        self.graphs: dict[Key, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = None

    def key(self, num_reqs: int, max_seq_len: int) -> Key | None:
        i = bisect.bisect_left(self.batch_sizes, num_reqs)
        j = bisect.bisect_left(self.buckets, max_seq_len)
        if i == len(self.batch_sizes) or j == len(self.buckets):
            return None
        return self.batch_sizes[i], self.buckets[j]

    @torch.inference_mode()
    def capture(self, forward: Callable[[int, int], object], pool=None, log: bool = True):
        """Capture ``forward(B, bucket)`` for every key; ``pool``: share another set's."""
        self.pool = pool
        keys = [(b, c) for c in reversed(self.buckets) for b in reversed(self.batch_sizes)]
        with frozen_gc():
            for i, (b, bucket) in enumerate(keys):
                graph, outputs = capture_region(partial(forward, b, bucket), self.pool)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(b, bucket)] = (graph, outputs)
                if log:
                    done = f"{i + 1}/{len(keys)}"
                    print(f"\rcapturing speculation graphs {done}", end="", flush=True)
        if log and keys:
            print(flush=True)
        return self.pool

    def replay(self, key: Key, forward: Callable[[int, int], object]) -> object:
        """The outputs of ``key``'s graph after a replay (eager ``forward`` if uncaptured)."""
        if key in self.graphs:
            graph, outputs = self.graphs[key]
            graph.replay()
            return outputs
        return forward(*key)


class VerifyGraphs:
    """Uniform verify steps: B requests x (1 + K) tokens -> logits [T, V], streams [T, N, D]."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches,
        buffers: StepBuffers,
        groups: Sequence[CacheGroupSpec],
        num_drafts: int,
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
    ) -> None:
        self.model, self.caches, self.buffers = model, caches, buffers
        self.width = 1 + num_drafts  # tokens per request
        self.set = _GraphSet(batch_sizes, buckets)
        device, n = buffers.device, max(batch_sizes)
        self.static = StaticInputs(n * (2 * self.width + 1), device)
        self.token_req = torch.arange(n, device=device).repeat_interleave(self.width)
        self.flat_index = torch.arange(n * self.width, device=device)
        cfg = model.cfg
        self.expert_counts = torch.zeros(
            cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64, device=device
        )
        self.meta = GraphMetadata(model, groups, buffers.tables, buffers.null_row, device)

    def inputs(self, b: int) -> list[torch.Tensor]:
        """The static inputs of B = b requests: ids, positions [T] and table rows [B]."""
        t = b * self.width
        return self.static.views([t, t, b])

    def _forward(self, b: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured region: metadata from the static buffers, forward, logits, streams."""
        t = b * self.width
        ids, positions, rows = self.inputs(b)
        token_req, every = self.token_req[:t], self.flat_index[:t]
        meta = self.meta(positions, token_req, rows, bucket, every, self.expert_counts)
        hidden, streams = self.model(ids, meta, self.caches, self.expert_counts)
        return self.model.compute_logits(hidden), streams

    def capture(self, pool=None, log: bool = True):
        return self.set.capture(self._forward, pool, log)

    def staged(self, key: Key, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids and positions [R, 1 + K] of the last run of ``key`` (its static
        inputs, on the device)."""
        ids, positions, _ = self.inputs(key[0])
        t = num_reqs * self.width
        return ids[:t].view(num_reqs, self.width), positions[:t].view(num_reqs, self.width)

    def key_for(self, inputs: StepInputs, num_draft_tokens: Sequence[int]) -> Key | None:
        """The graph of a uniform verify step (every request samples K drafts), or None.
        ``num_draft_tokens``: per sampled request."""
        num_reqs = len(inputs.rows)
        if (
            not num_reqs
            or len(inputs.input_ids) != num_reqs * self.width
            or len(num_draft_tokens) != num_reqs
            or any(m != self.width - 1 for m in num_draft_tokens)
        ):
            return None
        return self.set.key(num_reqs, inputs.max_seq_len)

    def run(
        self,
        key: Key,
        inputs: StepInputs,
        table_writes: tuple[np.ndarray, np.ndarray],
        feed: Feed | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T, V], streams [T, N, D], expert_counts [L, E]) of the step, valid until
        the next run. ``feed``: writes ids still on the device (drafts proposed there) into
        the uploaded input ids."""
        b, t = key[0], len(inputs.rows) * self.width
        ids, positions = (pad_to(a, b * self.width) for a in (inputs.input_ids, inputs.positions))
        rows = pad_to(np.asarray(inputs.rows, dtype=np.int64), b, self.buffers.null_row)
        fields = [ids, positions, rows]
        self.buffers.apply_writes(*self.buffers.upload(table_writes, self.static.buffer, fields))
        if feed is not None:
            feed(self.inputs(b)[0])
        logits, streams = self.set.replay(key, self._forward)
        self.buffers.fence()
        return logits[:t], streams[:t], self.expert_counts


class DraftGraphs:
    """The draft model's chained steps: one token for each of B requests -> logits [B, V].

    ``tables``: the draft's groups' device block tables under the names its model reads;
    ``null_row``: their all-null row (padding)."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches,
        groups: Sequence[CacheGroupSpec],
        tables: Mapping[str, torch.Tensor],
        null_row: int,
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
    ) -> None:
        self.model, self.caches, self.null_row = model, caches, null_row
        self.set = _GraphSet(batch_sizes, buckets)
        device = next(iter(tables.values())).device
        n = max(batch_sizes)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows = torch.full((n,), null_row, dtype=torch.int64, device=device)
        self.token_req = torch.arange(n, device=device)
        self.meta = GraphMetadata(model, groups, tables, null_row, device)

    def _forward(self, b: int, bucket: int) -> torch.Tensor:
        req = self.token_req[:b]
        meta = self.meta(self.positions[:b], req, self.rows[:b], bucket, req)
        hidden, _ = self.model(self.input_ids[:b], meta, self.caches)
        return self.model.compute_logits(hidden)

    def capture(self, pool=None, log: bool = True):
        return self.set.capture(self._forward, pool, log)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, max_len: int
    ) -> torch.Tensor | None:
        """input_ids, positions, rows: [W] device tensors; max_len: host bound on
        positions + 1. Logits [W, V] (valid until the next run), or None when no graph
        fits (the caller runs eagerly)."""
        num = input_ids.shape[0]
        key = self.set.key(num, max_len)
        if key is None:
            return None
        b = key[0]
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.rows[:num].copy_(rows)
        if b > num:  # padding: null rows, position 0 (writes land in the null block)
            self.input_ids[num:b].zero_()
            self.positions[num:b].zero_()
            self.rows[num:b].fill_(self.null_row)
        return self.set.replay(key, self._forward)[:num]


class ProposalGraphs:
    """What both proposal graphs share: ``width`` padded rows per request (the pad request
    B owns the padding, on the null row), their static inputs, staged on the device from
    the verify step's outputs (:meth:`rows`). Subclasses set ``width`` and define
    ``_forward(b, bucket) -> drafts [b, K]``."""

    def __init__(
        self,
        buffers: StepBuffers,
        num_drafts: int,
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
        width: int,
    ) -> None:
        self.buffers, self.null_row = buffers, buffers.null_row
        self.num_drafts, self.width = num_drafts, width
        self.set = _GraphSet(batch_sizes, buckets)
        device, n = buffers.device, max(batch_sizes)
        self.max_rows = n * width
        self.static = StaticInputs(3 * self.max_rows + 2 * n + 1, device)
        self.flat_index = torch.arange(self.max_rows, device=device)

    def inputs(self, b: int) -> list[torch.Tensor]:
        """The static inputs of B = b requests: per flat row [B * width] its token, position
        and request, per request [B + 1] its table row (B: the pad request's, null), and
        per request [B] its last row."""
        t = b * self.width
        return self.static.views([t, t, t, b + 1, b])

    def _forward(self, b: int, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def capture(self, pool=None, log: bool = True):
        return self.set.capture(self._forward, pool, log)

    def rows(
        self,
        first_ids: torch.Tensor,
        target: torch.Tensor,
        base: torch.Tensor,
        accepted: torch.Tensor,
        pad: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The proposal's rows of R verified requests -> per flat row [R * width] its token,
        position and request (``pad`` on padding), per request [R] its last row.
        first_ids [R]: x_L; target [R, 1 + K]: the verify's tokens t_0 .. t_K; base [R]: L;
        accepted [R]: a, the drafts accepted (t_0 .. t_a are emitted).

        The MTP drafter's rows (width 1 + K) are t_0 .. t_a at L + 1 ..; the draft
        model's (width 2 + K: one row more, ``lead``) are x_L, t_0 .. t_a at L ..."""
        lead = self.width - target.shape[1]
        tokens = torch.cat([first_ids[:, None], target], dim=1) if lead else target
        r, w = tokens.shape
        i = torch.arange(w, device=tokens.device)
        real = i[None, :] <= accepted[:, None] + lead
        req = torch.arange(r, device=tokens.device)
        return (
            torch.where(real, tokens, 0).flatten(),
            torch.where(real, base[:, None] + 1 - lead + i, 0).flatten(),
            torch.where(real, req[:, None], pad).flatten(),
            req * w + accepted + lead,
        )

    def run(
        self,
        first_ids: torch.Tensor,
        target: torch.Tensor,
        base: torch.Tensor,
        accepted: torch.Tensor,
        streams: torch.Tensor,
        rows: Sequence[int],
        max_len: int,
    ) -> torch.Tensor | None:
        """The drafts [R, K] after a uniform verify step (valid until the next run), or None
        when no key fits ``max_len`` (host bound on every position + 1). Every input but the
        block-table ``rows`` is a device tensor of the verify step (see :meth:`rows`;
        ``streams`` [R (1 + K), N, D] its final streams): the replay follows the verify on
        the stream, with no host round trip."""
        num = len(rows)
        key = self.set.key(num, max_len)
        if key is None:
            return None
        b = key[0]
        tokens, positions, token_req, last = self.rows(first_ids, target, base, accepted, b)
        tokens_at, positions_at, token_req_at, rows_at, last_at = self.inputs(b)
        staged = (
            (tokens_at, tokens, 0),
            (positions_at, positions, 0),
            (token_req_at, token_req, b),
        )
        for view, values, pad in (*staged, (last_at, last, 0)):
            view[: values.shape[0]].copy_(values)
            view[values.shape[0] :].fill_(pad)
        req_rows = pad_to(np.asarray(rows, dtype=np.int64), b + 1, self.null_row)
        self.buffers.upload([], rows_at, [req_rows])
        self._stage_streams(streams)
        logits = self.set.replay(key, self._forward)
        self.buffers.fence()
        return logits[:num]

    def _stage_streams(self, streams: torch.Tensor) -> None:
        """The verify step's final streams, for a drafter that reads them (MTP)."""


class MTPGraphs(ProposalGraphs):
    """The MTP drafter's greedy proposal after a uniform verify step: B requests x (1 + K)
    rows of the verify's final streams -> drafts [B, K].

    Row i of request r is the MTP row of position L_r + 1 + i (streams at L_r + i, token
    L_r + 1 + i) while i < kept_r; the rows past kept_r are padding: they belong to the
    pad request (index B, the null block-table row), so they write only the null block.
    ``last[r]``: the flat row of request r's last kept row, whose hidden state gives draft
    1 and whose streams start the chain."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches,
        buffers: StepBuffers,
        swa: CacheGroupSpec,
        num_drafts: int,
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
    ) -> None:
        super().__init__(buffers, num_drafts, batch_sizes, buckets, width=1 + num_drafts)
        self.model, self.caches = model, caches
        self.meta = GraphMetadata(model, [swa], buffers.tables, buffers.null_row, buffers.device)
        cfg, rows = model.cfg, self.max_rows
        self.streams = torch.zeros(
            rows, cfg.hc_mult, cfg.hidden_size, dtype=model.head.weight.dtype,
            device=buffers.device,
        )  # fmt: skip

    def _forward(self, b: int, bucket: int) -> torch.Tensor:
        t = b * self.width
        tokens, positions, token_req, rows, last = self.inputs(b)  # rows[b]: the pad request's
        # the padding writes the null block: unmasked, as the eager proposal's first pass
        meta = self.meta(positions, token_req, rows, bucket, masked=False)
        hidden, x = self.model.mtp_forward(0, tokens, self.streams[:t], meta, self.caches)
        draft = self.model.compute_logits(hidden[last]).argmax(dim=-1)
        drafts = [draft]
        x, positions = x[last], positions[last]
        for _ in range(1, self.num_drafts):
            positions = positions + 1
            # masked: the padded requests' rows (rows[r] == null_row) are padding
            meta = self.meta(positions, self.flat_index[:b], rows[:b], bucket)
            hidden, x = self.model.mtp_forward(0, draft, x, meta, self.caches)
            draft = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)

    def _stage_streams(self, streams: torch.Tensor) -> None:
        t = streams.shape[0]
        self.streams[:t].copy_(streams)
        self.streams[t:].zero_()  # padded requests' rows: finite values


class DraftProposalGraphs(ProposalGraphs):
    """The draft model's greedy proposal after a uniform verify step: B requests, each its
    kept tokens and y (rows L .. L + kept of the draft's caches, padded to 2 + K rows on
    the pad request B, the null row), then K - 1 chained steps -> drafts [B, K].

    ``tables``: the draft's groups' device block tables under the names its model reads.
    Every token is a closing candidate, masked by its request's row (padding compresses
    into the null block only)."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches,
        buffers: StepBuffers,
        groups: Sequence[CacheGroupSpec],
        tables: Mapping[str, torch.Tensor],
        num_drafts: int,
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
    ) -> None:
        super().__init__(buffers, num_drafts, batch_sizes, buckets, width=2 + num_drafts)
        self.model, self.caches = model, caches
        self.meta = GraphMetadata(model, groups, tables, buffers.null_row, buffers.device)

    def _hidden(self, ids, positions, token_req, rows, bucket: int) -> torch.Tensor:
        every = self.flat_index[: positions.shape[0]]
        meta = self.meta(positions, token_req, rows, bucket, every)
        hidden, _ = self.model(ids, meta, self.caches)
        return hidden

    def _forward(self, b: int, bucket: int) -> torch.Tensor:
        tokens, positions, token_req, rows, last = self.inputs(b)  # rows[b]: the pad request's
        hidden = self._hidden(tokens, positions, token_req, rows, bucket)
        draft = self.model.compute_logits(hidden[last]).argmax(dim=-1)
        drafts, positions, req = [draft], positions[last], self.flat_index[:b]
        for _ in range(1, self.num_drafts):
            positions = positions + 1
            hidden = self._hidden(draft, positions, req, rows[:b], bucket)
            draft = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)
