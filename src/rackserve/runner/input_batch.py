"""The runner's persistent batch: per-request state and block tables, updated from each
SchedulerOutput's deltas, and the CPU half of a step (flat inputs, sampling tensors).

Like vLLM's persistent batch, everything a request keeps for its lifetime is written once,
into its row, when it joins: block tables (appended from deltas) and its sampling
parameters (numpy columns). A step then gathers its rows with one fancy index per column
instead of re-reading every request's SamplingParams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rackserve.engine.outputs import SchedulerOutput, TokenLogprobs
from rackserve.request import SamplingParams
from rackserve.runner.inputs import BlockTables, StepInputs, build_batch_inputs
from rackserve.runner.sampler import SamplingTensors, noise_seed, pad_token_ids


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


class SamplingParamTable:
    """Sampling parameters per persistent-batch row, as numpy columns.

    Holds the values :meth:`SamplingTensors.from_params` packs (greedy rows neutral), as
    float64 so the "does any row need this filter" tests see the values the user gave;
    :meth:`gather` must produce exactly what ``from_params`` produces for the same
    requests (tests/runner/test_fastpath_batch.py checks it).
    """

    def __init__(self, max_num_rows: int, vocab_size: int) -> None:
        n = max_num_rows
        self.vocab_size = vocab_size
        self.params: list[SamplingParams | None] = [None] * n
        self.num_prompt_tokens = np.zeros(n, dtype=np.int64)
        self.temperature = np.ones(n)
        self.is_greedy = np.zeros(n, dtype=bool)
        self.top_k = np.full(n, vocab_size, dtype=np.int64)
        self.top_p = np.ones(n)
        self.min_p = np.zeros(n)
        self.presence_penalty = np.zeros(n)
        self.frequency_penalty = np.zeros(n)
        self.repetition_penalty = np.ones(n)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.wants_logprobs = np.zeros(n, dtype=bool)
        self.num_logprobs = np.zeros(n, dtype=np.int64)  # read where wants_logprobs
        self.seed = np.zeros(n, dtype=np.int64)

    def set_row(self, row: int, p: SamplingParams, num_prompt_tokens: int, seed: int) -> None:
        """`seed`: the row's noise seed (``p.seed`` when set, else one drawn for it)."""
        greedy = p.is_greedy
        self.params[row] = p
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.is_greedy[row] = greedy
        self.top_k[row] = p.top_k if p.top_k > 0 and not greedy else self.vocab_size
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.min_tokens[row] = p.min_tokens
        self.wants_logprobs[row] = p.logprobs is not None
        self.num_logprobs[row] = p.logprobs or 0
        self.seed[row] = noise_seed(seed)

    def gather(
        self,
        rows: np.ndarray,
        token_ids: Sequence[list[int]],
        eos_token_ids: Sequence[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        """SamplingTensors of ``rows`` [R] (in that order). ``token_ids[i]`` (prompt + output
        so far) belongs to ``rows[i]``; it is only sliced when a penalty or min_tokens
        needs the prompt or output part."""
        vocab_size = self.vocab_size
        prompt_lens = self.num_prompt_tokens[rows].tolist()

        def prompts() -> list[list[int]]:
            return [ids[:n] for ids, n in zip(token_ids, prompt_lens, strict=True)]

        def outputs() -> list[list[int]]:
            return [ids[n:] for ids, n in zip(token_ids, prompt_lens, strict=True)]

        def column(values: np.ndarray, dtype: np.dtype) -> torch.Tensor:
            return torch.from_numpy(values.astype(dtype)).to(device)

        is_greedy = self.is_greedy[rows]
        top_k = self.top_k[rows]
        top_p = self.top_p[rows]
        min_p = self.min_p[rows]
        presence = self.presence_penalty[rows]
        frequency = self.frequency_penalty[rows]
        repetition = self.repetition_penalty[rows]
        use_presence_or_frequency = bool(presence.any() or frequency.any())
        use_repetition = bool((repetition != 1.0).any())
        blocked = None
        min_tokens = self.min_tokens[rows]
        if min_tokens.any():
            blocked = [[] for _ in range(len(rows))]
            for i in np.flatnonzero(min_tokens).tolist():
                p = self.params[rows[i]]
                assert p is not None
                if len(token_ids[i]) - prompt_lens[i] < p.min_tokens:
                    blocked[i] = ([] if p.ignore_eos else list(eos_token_ids)) + p.stop_token_ids
        wants = self.wants_logprobs[rows]
        positions = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        return SamplingTensors(
            temperature=column(self.temperature[rows], np.float32),
            is_greedy=torch.from_numpy(is_greedy).to(device),
            top_k=column(top_k, np.int64) if (top_k < vocab_size).any() else None,
            top_p=column(top_p, np.float32) if (top_p < 1.0).any() else None,
            min_p=column(min_p, np.float32) if (min_p > 0.0).any() else None,
            presence_penalty=column(presence, np.float32) if use_presence_or_frequency else None,
            frequency_penalty=column(frequency, np.float32) if use_presence_or_frequency else None,
            repetition_penalty=column(repetition, np.float32) if use_repetition else None,
            output_token_ids=pad_token_ids(outputs(), vocab_size, device)
            if use_presence_or_frequency or use_repetition
            else None,
            prompt_token_ids=pad_token_ids(prompts(), vocab_size, device)
            if use_repetition
            else None,
            blocked_token_ids=pad_token_ids(blocked, vocab_size, device)
            if blocked is not None and any(blocked)
            else None,
            seeds=column(self.seed[rows], np.int64),
            positions=column(positions, np.int64),
            num_logprobs=int(self.num_logprobs[rows][wants].max()) if wants.any() else None,
            all_greedy=bool(is_greedy.all()),
            all_random=not is_greedy.any(),
        )


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
    ) -> None:
        """`seed` draws the noise seeds of random requests that bring none."""
        self.block_tables = BlockTables(group_block_tokens, max_num_reqs, max_model_len)
        self.sampling_params = SamplingParamTable(max_num_reqs, vocab_size)
        self.requests: dict[str, RunnerRequest] = {}
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
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
        inputs = build_batch_inputs(
            token_ids, computed, list(map(sched.num_scheduled_tokens.__getitem__, req_ids)), rows
        )
        mask = inputs.sample_mask
        if all(mask):  # a decode step: every request samples, nothing to filter
            sampled, sampled_token_ids = reqs, token_ids
            sampled_rows = np.array(rows, dtype=np.int64)
        else:
            sampled = [r for r, s in zip(reqs, mask, strict=True) if s]
            sampled_rows = np.array(rows, dtype=np.int64)[np.array(mask, dtype=bool)]
            sampled_token_ids = [r.token_ids for r in sampled]
        sampling = None
        if sampled:
            sampling = self.sampling_params.gather(
                sampled_rows, sampled_token_ids, self.eos_token_ids, self.device
            )
        return PreparedStep(reqs, inputs, sampled, sampling, self.block_tables.drain_writes())
