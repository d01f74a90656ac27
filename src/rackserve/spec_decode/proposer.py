"""Drafters: K tokens per request per step, from the target's MTP layer or a draft model.

Shape legend: R requests in the step, T tokens of the step, W requests that want drafts,
N mHC streams, D hidden, K draft tokens.

Both drafters run after the target's verified step, on what it kept. For request r with
L = num_computed tokens before the step, ``kept`` tokens of the step whose KV stands (the
chunk, or 1 + accepted drafts) and, when it sampled, the new token y at L + kept::

    positions   L ........ L+kept-1   L+kept     L+kept+1 ... L+kept+K-1
    target      [ kept: KV stands   ]  y
    MTP         rows L+1 .. L+kept  (h_p, x_{p+1}) -> draft 1;  chained -> drafts 2..K
    draft model rows L .. L+kept (x_L .. y)       -> draft 1;  chained -> drafts 2..K

Rows written past the kept tokens (chained steps, rejected drafts) hold guesses. Every
cache row is addressed by position and a query only reads rows at or before its own
position, so the next step rewrites them before any query reads them: rollback is free.
The scheduler allocates K lookahead positions past each step's tokens for the chain.
Greedy requests draft the argmax; random requests sample their drafts from the draft's
distribution q under their own temperature/top-k/top-p/min-p (``verify.sample_drafts``),
and q is kept for the next step's rejection rule (``verify.DraftDistributions``).

Here: what a drafter reads from the verified step (``VerifiedStep``) and the drafters' base
(``Proposer``: the drafts from logits, q kept, the verify step's graphs); the two drafters
and ``build_proposer``, which picks one: ``drafters.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import KVCacheTensors
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.cuda_graph import release_warm_up_memory
from rackserve.runner.sampler import Resample
from rackserve.runner.sampling_tensors import SamplingTensors
from rackserve.runner.step_buffers import StepBuffers
from rackserve.spec_decode.graphs import ProposalGraphs, VerifyGraphs
from rackserve.spec_decode.verify import DraftDistributions, accepted_counts, sample_drafts


@dataclass(frozen=True)
class VerifiedStep:
    """What a drafter reads from one step, per request r in the step's order (host lists)
    plus the target's final streams [T, N, D] in flat step order."""

    token_ids: Sequence[list[int]]  # after the step: kept tokens, then y if it sampled
    num_computed: Sequence[int]  # L
    num_kept: Sequence[int]  # step tokens whose KV stands
    sampled: Sequence[bool]  # y was appended
    wants_draft: Sequence[bool]  # sampled and may speculate
    rows: Sequence[int]  # block-table rows
    query_start_loc: Sequence[int]  # [R + 1] into the flat step
    streams: torch.Tensor
    req_ids: Sequence[str] = ()
    is_greedy: Sequence[bool] = ()  # [R]; empty: every request greedy
    sampling: SamplingTensors | None = None  # the step's sampling rows
    num_rows: Sequence[int] = ()  # [sampled requests] their rows in ``sampling``

    def draft_sampling(self, wanted: Sequence[int]) -> SamplingTensors | None:
        """[W] the sampling row of each wanted request (its last row: the params are the
        request's, the position is replaced per draft); None when all are greedy."""
        greedy = [self.is_greedy[r] if self.is_greedy else True for r in wanted]
        if self.sampling is None or all(greedy):
            return None
        sampled = [r for r, s in enumerate(self.sampled) if s]
        last_row = dict(zip(sampled, itertools.accumulate(self.num_rows), strict=True))
        return self.sampling.select([last_row[r] - 1 for r in wanted], greedy)


@dataclass(frozen=True)
class VerifyOutputs:
    """A uniform verify step's tensors on the device, R requests x (1 + K) tokens, for the
    drafters' device route (``Proposer.propose_verified``)."""

    input_ids: torch.Tensor  # [R, 1 + K]: x_L, d_1 .. d_K
    positions: torch.Tensor  # [R, 1 + K]: L .. L + K
    target_ids: torch.Tensor  # [R, 1 + K]: the sampled t_0 .. t_K
    streams: torch.Tensor  # [R (1 + K), N, D] the final streams
    rows: Sequence[int]  # [R] block-table rows (host)
    max_len: int  # host bound on every position the proposal writes, + 1


class Proposer:
    """K draft tokens for each request that wants them (greedy, or sampled from q)."""

    def __init__(self, num_tokens: int, tables: Mapping[str, torch.Tensor]) -> None:
        self.num_tokens = num_tokens
        self.tables = tables  # device block tables of every group, [rows + 1, cols]
        self.device = next(iter(tables.values())).device
        self.distributions = DraftDistributions()  # q of the random drafts, one step long
        self.graphs: VerifyGraphs | None = None  # the verify step's graphs (CUDA)
        self.proposal_graphs: ProposalGraphs | None = None  # the drafter's whole proposal

    def enable_graphs(
        self,
        model: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        buffers: StepBuffers,
        groups: Sequence[CacheGroupSpec],
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
        capture: bool = True,
        log: bool = True,
    ) -> None:
        """Graphs of uniform verify steps over the target's ``groups``, then the drafter's
        own (``_drafter_graphs``), all in one memory pool; ``capture=False`` (CPU tests):
        the same padded steps run eagerly."""
        self.graphs = VerifyGraphs(
            model, caches, buffers, groups, self.num_tokens, batch_sizes, buckets
        )
        drafter = self._drafter_graphs(buffers, batch_sizes, buckets)
        if capture:
            self.graphs.capture(log=log)
            for graphs in drafter:
                graphs.capture(pool=self.graphs.set.pool, log=log)
            release_warm_up_memory()

    def _drafter_graphs(
        self, buffers: StepBuffers, batch_sizes: Sequence[int], buckets: Sequence[int]
    ) -> list:
        """Make the drafter's graph sets (each with ``capture(pool, log)``); none here."""
        return []

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        raise NotImplementedError

    def propose_verified(self, verified: VerifyOutputs) -> torch.Tensor | None:
        """The drafts [R, K] after a uniform verify step whose requests all draft greedily,
        from its outputs on the device: the drafter's proposal graph replays right behind
        the verify (the acceptance counted on the device) with no host round trip, and the
        drafts stay there for the next step's inputs (``ModelRunner._take_drafts``). None
        when no proposal graph fits: then :meth:`propose` runs after the read-back."""
        graphs = self.proposal_graphs
        if graphs is None:
            return None
        ids, target = verified.input_ids, verified.target_ids
        drafts = graphs.run(
            ids[:, 0], target, verified.positions[:, 0], accepted_counts(ids[:, 1:], target),
            verified.streams, verified.rows, verified.max_len,
        )  # fmt: skip
        if drafts is not None:
            self.distributions.keep([], [], None, [])  # greedy: no q to keep
        return drafts

    def resampler(
        self, reqs: Sequence[Any], num_rows: Sequence[int], sampling: SamplingTensors
    ) -> Resample | None:
        """The rejection step of this step's sampling, or None. ``reqs``: the sampled
        requests (``req_id``, ``token_ids`` ending with the drafts they verify), ``num_rows``
        their logits rows (1 + drafts), ``sampling`` those rows."""
        return self.distributions.resampler(
            [r.req_id for r in reqs],
            [r.token_ids[len(r.token_ids) - n + 1 :] for r, n in zip(reqs, num_rows, strict=True)],
            [0, *itertools.accumulate(num_rows)][:-1],
            sampling,
        )

    @staticmethod
    def _draft(
        logits: torch.Tensor, sampling: SamplingTensors | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [W, V] of the wanted requests, ``sampling`` their rows, positions [W] the
        drafts' -> (tokens [W], q [W, V] or None when all are greedy)."""
        if sampling is None:
            return logits.argmax(dim=-1), None
        return sample_drafts(logits, sampling, positions)

    def _chain_start(self, step: VerifiedStep, wanted: list[int]) -> torch.Tensor:
        """[W] the position of each wanted request's first draft (past its last token)."""
        return self._device([len(step.token_ids[r]) for r in wanted])

    def _finish(
        self,
        step: VerifiedStep,
        wanted: list[int],
        drafts: list[torch.Tensor],
        probs: list[torch.Tensor | None],
    ) -> list[list[int]]:
        """drafts, probs: K of [W], [W, V] -> per request its K drafts (q kept)."""
        tokens = torch.stack(drafts, dim=1).tolist()  # [W, K]
        known = [q for q in probs if q is not None]
        if step.req_ids and len(known) == len(probs):
            self.distributions.keep(
                [step.req_ids[r] for r in wanted],
                tokens,
                torch.stack(known, dim=1),  # [W, K, V]
                [step.is_greedy[r] for r in wanted],
            )
        else:  # all greedy: nothing to keep
            self.distributions.keep([], [], None, [])
        return _scatter(tokens, wanted, len(step.num_kept))

    def _device(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=self.device)


def _scatter(drafts: list[list[int]], wanted: list[int], num_reqs: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(num_reqs)]
    for r, d in zip(wanted, drafts, strict=True):
        out[r] = d
    return out
