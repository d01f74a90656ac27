"""The runner's persistent batch: per-request state and block tables, updated from each
SchedulerOutput's deltas, and the CPU half of a step (flat inputs, sampling tensors).

Like vLLM's persistent batch, everything a request keeps for its lifetime is written once,
into its row, when it joins: block tables (appended from deltas) and its sampling
parameters (numpy columns). A step then gathers its rows with one fancy index per column
instead of re-reading every request's SamplingParams.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from rackserve.device import PinnedStaging
from rackserve.engine.outputs import SchedulerOutput, TokenLogprobs
from rackserve.request import SamplingParams
from rackserve.runner.inputs import BlockTables, StepInputs, build_batch_inputs
from rackserve.runner.sampling_tensors import SamplingParamTable, SamplingTensors
from rackserve.spec_decode.verify import verification_prefixes

if TYPE_CHECKING:
    from rackserve.runner.step_handle import DeviceStep


@dataclass(slots=True)  # slots: read per request per step, keep it compact
class RunnerRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class PreparedStep:
    reqs: list[RunnerRequest]  # in flat-batch order
    inputs: StepInputs
    sampled_reqs: list[RunnerRequest]  # those that sample this step, in order
    sampling: SamplingTensors | None
    # block-table writes since the last step (BlockTables.drain_writes): flat index, id
    table_writes: tuple[np.ndarray, np.ndarray]
    # per sampled request, the drafts it verifies (their logits rows follow its first row);
    # empty when no request verifies drafts
    num_draft_tokens: list[int] = field(default_factory=list)
    # drafts fed on the device from the step that proposed them (ModelRunner._take_drafts):
    # (request index, its row in the source, how many); their ids join the token lists at
    # the collect, from the source's host copy
    pending_drafts: list[tuple[int, int, int]] = field(default_factory=list)
    drafts_source: DeviceStep | None = None


class InputBatch:
    def __init__(
        self,
        group_block_tokens: dict[str, int],
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device | str,
        seed: int = 0,
        ring_widths: Mapping[str, int] | None = None,
        max_step_tokens: int | None = None,
    ) -> None:
        """`seed` draws the noise seeds of random requests that bring none. `ring_widths`:
        the sliding groups' block-table rings (inputs.ring_widths; None: linear tables),
        sized for steps of at most `max_step_tokens` tokens per request (drafts included;
        a step past it raises, as its slots would share ring columns)."""
        self.block_tables = BlockTables(
            group_block_tokens, max_num_reqs, max_model_len, ring_widths
        )
        self.max_step_tokens = max_step_tokens
        self.sampling_params = SamplingParamTable(max_num_reqs, vocab_size)
        self.requests: dict[str, RunnerRequest] = {}
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
        self._staging = PinnedStaging(self.device)  # the sampling tensors' one copy a step
        self._seed_rng = np.random.default_rng(seed)
        # Seeds drawn for unseeded requests, kept until they finish (not when preempted), so
        # a recomputed request samples with the same noise: its text does not depend on load.
        self._drawn_seeds: dict[str, int] = {}
        # The last step's request order and what prepare() looked up for it: a decode step
        # with no request joining or leaving schedules the same requests, in the same order.
        self._last: tuple[list[str], list[RunnerRequest], list[int], list[list[int]]] | None = None

    def update(self, sched: SchedulerOutput) -> None:
        if sched.new_reqs or sched.finished_req_ids or sched.preempted_req_ids:
            self._last = None  # requests or rows change: prepare() looks them up again
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.block_tables.remove(req_id)
        for req_id in sched.finished_req_ids:
            self._drawn_seeds.pop(req_id, None)
        for new in sched.new_reqs:
            params = new.sampling_params
            self.requests[new.req_id] = RunnerRequest(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, params
            )
            row = self.block_tables.add(new.req_id, new.block_ids)
            self.sampling_params.set_row(
                row, params, new.num_prompt_tokens, self._seed_of(new.req_id, params)
            )
        cached = sched.cached_reqs
        append = self.block_tables.append
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_block_ids is not None:  # most decode steps get no block
                append(req_id, new_block_ids)

    def _seed_of(self, req_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        if params.is_greedy:
            return 0  # draws no noise
        seed = self._drawn_seeds.get(req_id)
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2**63))
            self._drawn_seeds[req_id] = seed
        return seed

    def prepare(self, sched: SchedulerOutput) -> PreparedStep | None:
        """Apply the deltas, then build this step's inputs; None for an empty step."""
        self.update(sched)
        cached = sched.cached_reqs
        last = self._last
        if last is not None and cached.req_ids == last[0]:
            # update() changed no request or row (else it reset _last), and no request joined:
            # the lookups of the last step still hold
            req_ids, reqs, rows, token_ids = last
            computed = cached.num_computed_tokens
        else:
            req_ids = [n.req_id for n in sched.new_reqs] + cached.req_ids
            if not req_ids:
                self._last = None
                return None
            computed = [n.num_computed_tokens for n in sched.new_reqs]
            computed += cached.num_computed_tokens
            reqs = list(map(self.requests.__getitem__, req_ids))
            rows = list(map(self.block_tables.row_of.__getitem__, req_ids))
            token_ids = [r.token_ids for r in reqs]
            self._last = req_ids, reqs, rows, token_ids
        limit = self.max_step_tokens
        if limit is not None and sched.total_num_scheduled_tokens > limit:  # else none can be
            worst = max(sched.num_scheduled_tokens.values())
            if worst > limit:
                raise ValueError(
                    f"a request was scheduled {worst} tokens in one step; the block-table "
                    f"rings hold steps of at most {limit} (max_num_batched_tokens)"
                )
        spec = sched.scheduled_spec_decode_tokens
        num_drafts = None
        if spec:
            # the drafts join the token lists until verified (ModelRunner truncates them)
            num_drafts = [len(spec.get(i, ())) for i in req_ids]
            for r, req_id in zip(reqs, req_ids, strict=True):
                if req_id in spec:
                    r.token_ids.extend(spec[req_id])
        inputs = build_batch_inputs(
            token_ids,
            computed,
            list(map(sched.num_scheduled_tokens.__getitem__, req_ids)),
            rows,
            num_drafts,
        )
        mask = inputs.sample_mask
        if all(mask):  # a decode step: every request samples, nothing to filter
            sampled, sampled_token_ids = reqs, token_ids
            sampled_rows = np.array(rows, dtype=np.int64)
        else:
            sampled = [r for r, s in zip(reqs, mask, strict=True) if s]
            sampled_rows = np.array(rows, dtype=np.int64)[np.array(mask, dtype=bool)]
            sampled_token_ids = [r.token_ids for r in sampled]
        sampled_drafts: list[int] = []
        if num_drafts is not None:
            sampled_drafts = [m for m, s in zip(num_drafts, mask, strict=True) if s]
            # one sampling row per verified position, each after its own prefix
            sampled_rows = np.repeat(sampled_rows, np.array(sampled_drafts, dtype=np.int64) + 1)
            sampled_token_ids = [
                prefix
                for ids, m in zip(sampled_token_ids, sampled_drafts, strict=True)
                for prefix in verification_prefixes(ids, m)
            ]
        sampling = None
        if sampled:
            sampling = self.sampling_params.gather(
                sampled_rows, sampled_token_ids, self.eos_token_ids, self.device, self._staging
            )
        return PreparedStep(
            reqs, inputs, sampled, sampling, self.block_tables.drain_writes(), sampled_drafts
        )
