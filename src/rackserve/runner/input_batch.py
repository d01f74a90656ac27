"""The runner's persistent batch: per-request state and block tables, updated from each
SchedulerOutput's deltas, and the CPU half of a step (flat inputs, sampling tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rackserve.engine.outputs import SchedulerOutput, TokenLogprobs
from rackserve.request import SamplingParams
from rackserve.runner.inputs import BlockTables, ScheduledRequest, StepInputs, build_step_inputs
from rackserve.runner.sampler import SamplingTensors, make_generator


@dataclass
class RunnerRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
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


class InputBatch:
    def __init__(
        self,
        group_block_tokens: dict[str, int],
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device | str,
    ) -> None:
        self.block_tables = BlockTables(group_block_tokens, max_num_reqs, max_model_len)
        self.requests: dict[str, RunnerRequest] = {}
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)

    def update(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.block_tables.remove(req_id)
        for new in sched.new_reqs:
            params = new.sampling_params
            generator = None if params.seed is None else make_generator(params.seed, self.device)
            self.requests[new.req_id] = RunnerRequest(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, params, generator
            )
            self.block_tables.add(new.req_id, new.block_ids)
        for cached in sched.cached_reqs:
            self.block_tables.append(cached.req_id, cached.new_block_ids)

    def prepare(self, sched: SchedulerOutput) -> PreparedStep | None:
        """Apply the deltas, then build this step's inputs; None for an empty step."""
        self.update(sched)
        scheduled = [(n.req_id, n.num_computed_tokens) for n in sched.new_reqs]
        scheduled += [(c.req_id, c.num_computed_tokens) for c in sched.cached_reqs]
        if not scheduled:
            return None
        reqs = [self.requests[req_id] for req_id, _ in scheduled]
        rows = self.block_tables.row_of
        inputs = build_step_inputs(
            [
                ScheduledRequest(
                    r.token_ids, c, sched.num_scheduled_tokens[r.req_id], rows[r.req_id]
                )
                for r, (_, c) in zip(reqs, scheduled, strict=True)
            ],
            self.device,
        )
        sampled = [r for r, s in zip(reqs, inputs.sample_mask, strict=True) if s]
        sampling = None
        if sampled:
            sampling = SamplingTensors.from_params(
                [r.sampling_params for r in sampled],
                prompt_token_ids=[r.token_ids[: r.num_prompt_tokens] for r in sampled],
                output_token_ids=[r.output_token_ids for r in sampled],
                vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
                device=self.device,
            )
        return PreparedStep(reqs, inputs, sampled, sampling)
