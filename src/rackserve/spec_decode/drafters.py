"""The two drafters behind ``proposer.Proposer`` and the choice between them
(``build_proposer``): ``MTPProposer`` chains the target's MTP layer K times on the target's
final streams; ``DraftModelProposer`` runs a second model over its own cache groups
(``draft_*``, read through ``PrefixedCaches``). Which rows each one writes, and why rollback
is free: ``proposer.py``. Shape legend as there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from rackserve.config import ConfigError, SpecConfig
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import (
    KVCacheTensors,
    StepMetadata,
    closing_tokens,
    compressed_ratios,
)
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.loader import load_model
from rackserve.runner.inputs import build_batch_inputs
from rackserve.runner.step_buffers import StepBuffers
from rackserve.spec_decode.checkpoint import DRAFT_PREFIX, NO_MTP, draft_config
from rackserve.spec_decode.graphs import DraftGraphs, DraftProposalGraphs, MTPGraphs
from rackserve.spec_decode.proposer import Proposer, VerifiedStep


class PrefixedCaches:
    """The draft model's view of the shared cache tensors: group ``swa`` is ``draft_swa``."""

    def __init__(self, caches: KVCacheTensors, prefix: str = DRAFT_PREFIX) -> None:
        self.caches, self.prefix = caches, prefix

    def flat(self, group: str, layer: int) -> torch.Tensor:
        return self.caches.flat(self.prefix + group, layer)


class MTPProposer(Proposer):
    """The target's MTP layer 0, chained K times (its embedding and head are shared)."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        swa: CacheGroupSpec,
        num_tokens: int,
        tables: Mapping[str, torch.Tensor],
    ) -> None:
        super().__init__(num_tokens, tables)
        if not model.has_mtp:
            raise ConfigError(NO_MTP)
        self.model, self.caches, self.swa = model, caches, swa

    def _drafter_graphs(
        self, buffers: StepBuffers, batch_sizes: Sequence[int], buckets: Sequence[int]
    ) -> list:
        self.proposal_graphs = MTPGraphs(
            self.model, self.caches, buffers, self.swa, self.num_tokens, batch_sizes, buckets
        )
        return [self.proposal_graphs]

    def _meta(
        self, positions: torch.Tensor, token_req: torch.Tensor, rows: torch.Tensor, max_len: int
    ) -> StepMetadata:
        """max_len: host bound on positions + 1 (no device read-back)."""
        tables = {self.swa.name: self.tables[self.swa.name][rows]}
        return StepMetadata.build([self.swa], positions, token_req, tables, max_len, {})

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        wanted = [r for r, w in enumerate(step.wants_draft) if w]
        idx, pos, req, nxt, last = [], [], [], [], []
        for r, (start, base, kept) in enumerate(
            zip(step.query_start_loc, step.num_computed, step.num_kept, strict=False)
        ):
            # MTP row p + 1 = (final streams at p, token p + 1): kept positions only
            tokens = step.token_ids[r]
            idx.extend(range(start, start + kept))
            pos.extend(range(base + 1, base + kept + 1))
            req.extend([r] * kept)
            nxt.extend(tokens[base + 1 : base + kept + 1])
            if step.wants_draft[r]:
                last.append(len(idx) - 1)
        if not idx:
            self.distributions.keep([], [], None, [])
            return [[] for _ in step.num_kept]
        rows = self._device(step.rows)
        positions = self._device(pos)
        max_len = max(pos) + 1
        meta = self._meta(positions, self._device(req), rows, max_len)
        streams = step.streams[self._device(idx)]
        # the MTP head on the rows that draft only (none: the layer runs for its caches)
        last_dev = self._device(last)
        hidden, x = self.model.mtp_forward(
            0, self._device(nxt), streams, meta, self.caches, head_rows=last_dev
        )
        if not wanted:
            self.distributions.keep([], [], None, [])
            return [[] for _ in step.num_kept]
        chain = self._chain_start(step, wanted)  # [W] position of draft 1
        sampling = step.draft_sampling(wanted)
        draft, q = self._draft(self.model.compute_logits(hidden), sampling, chain)
        drafts, probs = [draft], [q]
        x, positions = x[last_dev], positions[last_dev]  # [W, N, D], [W]
        token_req = torch.arange(len(wanted), device=self.device)
        rows = rows[self._device(wanted)]
        for j in range(1, self.num_tokens):
            positions, max_len = positions + 1, max_len + 1
            meta = self._meta(positions, token_req, rows, max_len)
            hidden, x = self.model.mtp_forward(0, draft, x, meta, self.caches)
            draft, q = self._draft(self.model.compute_logits(hidden), sampling, chain + j)
            drafts.append(draft)
            probs.append(q)
        return self._finish(step, wanted, drafts, probs)


class DraftModelProposer(Proposer):
    """A second DeepSeek-V4-architecture model with its own cache groups, run K times."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        groups: Sequence[CacheGroupSpec],
        num_tokens: int,
        tables: Mapping[str, torch.Tensor],
    ) -> None:
        super().__init__(num_tokens, tables)
        self.model = model
        self.caches = PrefixedCaches(caches)
        # the draft's groups under the names its model reads
        self.groups = [
            replace(g, name=g.name[len(DRAFT_PREFIX) :])
            for g in groups
            if g.name.startswith(DRAFT_PREFIX)
        ]
        self.ratios = compressed_ratios(self.groups)
        self.draft_graphs: DraftGraphs | None = None  # the chain after an eager first step

    def _drafter_graphs(
        self, buffers: StepBuffers, batch_sizes: Sequence[int], buckets: Sequence[int]
    ) -> list:
        tables = {g.name: self.tables[DRAFT_PREFIX + g.name] for g in self.groups}
        self.draft_graphs = DraftGraphs(
            self.model, self.caches, self.groups, tables, buffers.null_row, batch_sizes, buckets
        )
        self.proposal_graphs = DraftProposalGraphs(
            self.model, self.caches, buffers, self.groups, tables, self.num_tokens,
            batch_sizes, buckets,
        )  # fmt: skip
        return [self.draft_graphs, self.proposal_graphs]

    def _chain_logits(
        self, draft: torch.Tensor, positions: np.ndarray, token_req: np.ndarray, rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits [W, V] of one chained step (draft [W] at positions [W]): a graph replay
        when one fits, else eager."""
        if self.draft_graphs is not None:
            max_len = int(positions.max()) + 1
            logits = self.draft_graphs.run(draft, self._device(positions), rows, max_len)
            if logits is not None:
                return logits
        return self.model.compute_logits(self._forward(draft, positions, token_req, rows))

    @classmethod
    def load(
        cls,
        spec: SpecConfig,
        target: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        groups: Sequence[CacheGroupSpec],
        tables: Mapping[str, torch.Tensor],
    ) -> DraftModelProposer:
        draft_config(spec, target.cfg)  # ConfigError before any weight is read
        device = next(target.parameters()).device
        model = load_model(spec.model, dtype=target.head.weight.dtype, device=device)
        return cls(model, caches, groups, spec.num_speculative_tokens, tables)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        token_req: np.ndarray,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        closing = {r: self._device(i) for r, i in closing_tokens(positions, self.ratios).items()}
        tables = {g.name: self.tables[DRAFT_PREFIX + g.name][rows] for g in self.groups}
        max_len = int(positions.max()) + 1
        meta = StepMetadata.build(
            self.groups, self._device(positions), self._device(token_req), tables, max_len,
            closing,
        )  # fmt: skip
        hidden, _ = self.model(input_ids, meta, self.caches)
        return hidden

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        wanted = [r for r, w in enumerate(step.wants_draft) if w]
        # the kept tokens and y: rows L .. L + kept of the draft's caches
        counts = [k + s for k, s in zip(step.num_kept, step.sampled, strict=True)]
        inputs = build_batch_inputs(
            list(step.token_ids), list(step.num_computed), counts, list(step.rows)
        )
        rows = self._device(step.rows)
        hidden = self._forward(
            self._device(inputs.input_ids), inputs.positions, inputs.token_req, rows
        )
        if not wanted:
            self.distributions.keep([], [], None, [])
            return [[] for _ in step.num_kept]
        ends = np.asarray(inputs.query_start_loc[1:], dtype=np.int64)[wanted] - 1
        chain = self._chain_start(step, wanted)  # [W] position of draft 1
        sampling = step.draft_sampling(wanted)
        draft, q = self._draft(
            self.model.compute_logits(hidden[self._device(ends)]), sampling, chain
        )
        drafts, probs = [draft], [q]
        positions = inputs.positions[ends]
        token_req = np.arange(len(wanted), dtype=np.int64)
        rows = rows[self._device(wanted)]
        for j in range(1, self.num_tokens):
            positions = positions + 1
            logits = self._chain_logits(draft, positions, token_req, rows)
            draft, q = self._draft(logits, sampling, chain + j)
            drafts.append(draft)
            probs.append(q)
        return self._finish(step, wanted, drafts, probs)


def build_proposer(
    spec: SpecConfig,
    model: DeepseekV4ForCausalLM,
    caches: KVCacheTensors,
    groups: Sequence[CacheGroupSpec],
    tables: Mapping[str, torch.Tensor],
) -> Proposer:
    """The drafter of ``spec`` over the runner's caches and device block tables."""
    if spec.method == "mtp":
        swa = next(g for g in groups if g.name == "swa")
        if model.cfg.num_hidden_layers not in swa.layer_ids:
            raise ValueError("the swa cache group lacks the MTP layer (spec_cache_groups)")
        return MTPProposer(model, caches, swa, spec.num_speculative_tokens, tables)
    return DraftModelProposer.load(spec, model, caches, groups, tables)
