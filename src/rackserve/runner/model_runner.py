"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the cache tensors and per-request state (token ids, block tables, generators) and
makes no policy: it computes exactly the tokens it was granted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rackserve.engine.outputs import RunnerOutput, SchedulerOutput, TokenLogprobs
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import ForwardBatch, KVCacheTensors
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.request import SamplingParams
from rackserve.runner.inputs import BlockTables, ScheduledRequest, build_step_inputs
from rackserve.runner.sampler import SamplingTensors, make_generator, sample


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


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        groups: list[CacheGroupSpec],
        num_blocks: dict[str, int],
        max_num_reqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.head.weight.dtype
        self.caches = KVCacheTensors(groups, num_blocks, self.dtype, self.device)
        self.block_tables = BlockTables(
            {g.name: g.block_tokens for g in groups}, max_num_reqs, max_model_len
        )
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.cfg.vocab_size
        self.requests: dict[str, RunnerRequest] = {}
        self.generator = make_generator(seed, self.device)  # unseeded random requests

    # ---- state updates from the scheduler ------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
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

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        order = [n.req_id for n in sched.new_reqs] + [c.req_id for c in sched.cached_reqs]
        computed = {n.req_id: n.num_computed_tokens for n in sched.new_reqs}
        computed.update((c.req_id, c.num_computed_tokens) for c in sched.cached_reqs)
        if not order:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        reqs = [self.requests[i] for i in order]
        inputs = build_step_inputs(
            [
                ScheduledRequest(
                    r.token_ids,
                    computed[r.req_id],
                    sched.num_scheduled_tokens[r.req_id],
                    self.block_tables.row_of[r.req_id],
                )
                for r in reqs
            ],
            self.device,
        )
        batch = ForwardBatch(
            inputs.positions,
            inputs.query_start_loc,
            inputs.num_computed_tokens,
            self.block_tables.tables,
            inputs.rows,
        )
        cfg = self.model.cfg
        expert_counts = torch.zeros(
            cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64, device=self.device
        )
        start = time.perf_counter()
        hidden, _ = self.model(inputs.input_ids, batch, self.caches, expert_counts)
        prompt_logprobs = self._prompt_logprobs(reqs, inputs.query_start_loc, computed, hidden)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, V]

        sampled_reqs = [r for r, s in zip(reqs, inputs.sample_mask, strict=True) if s]
        sampled: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[TokenLogprobs]] | None = None
        if sampled_reqs:
            tensors = SamplingTensors.from_params(
                [r.sampling_params for r in sampled_reqs],
                prompt_token_ids=[r.token_ids[: r.num_prompt_tokens] for r in sampled_reqs],
                output_token_ids=[r.output_token_ids for r in sampled_reqs],
                vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
                device=self.device,
            )
            generators = {i: r.generator for i, r in enumerate(sampled_reqs) if r.generator}
            out = sample(logits, tensors, generators, self.generator)
            token_ids = out.token_ids.tolist()
            rows = iter(range(len(sampled_reqs)))
            if out.logprobs is not None:
                logprobs = [[] for _ in reqs]
            for k, needs in enumerate(inputs.sample_mask):
                if not needs:
                    continue
                row = next(rows)
                reqs[k].token_ids.append(token_ids[row])
                sampled[k] = [token_ids[row]]
                num = reqs[k].sampling_params.logprobs
                if logprobs is not None and num is not None:
                    assert out.logprobs is not None
                    logprobs[k] = [_token_logprobs(out.logprobs, row, num)]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return RunnerOutput(
            req_ids=order,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            expert_counts=expert_counts,
            forward_time_s=time.perf_counter() - start,
        )

    def _prompt_logprobs(
        self,
        reqs: list[RunnerRequest],
        starts: list[int],
        computed: dict[str, int],
        hidden: torch.Tensor,
    ) -> dict[str, list[TokenLogprobs | None]]:
        """Accumulate prompt logprobs chunk by chunk; hand them out when the prompt ends."""
        done: dict[str, list[TokenLogprobs | None]] = {}
        for k, r in enumerate(reqs):
            num = r.sampling_params.prompt_logprobs
            c = computed[r.req_id]
            if num is None or c >= r.num_prompt_tokens:
                continue
            if c == 0:
                r.prompt_logprobs = [None]  # the first prompt token has no logprob
            end = min(starts[k + 1] - starts[k], r.num_prompt_tokens - 1 - c)
            if end > 0:
                logits = self.model.compute_logits(hidden[starts[k] : starts[k] + end])
                lp = logits.log_softmax(dim=-1)
                targets = torch.tensor(r.token_ids[c + 1 : c + 1 + end], device=lp.device)
                chosen = lp.gather(1, targets[:, None])
                ranks = (lp > chosen).sum(dim=-1) + 1
                top = lp.topk(num, dim=-1) if num else None
                for j in range(end):
                    ids = [int(targets[j])] + (top.indices[j].tolist() if top else [])
                    vals = [float(chosen[j])] + (top.values[j].tolist() if top else [])
                    r.prompt_logprobs.append(TokenLogprobs(ids, vals, int(ranks[j])))
            if c + starts[k + 1] - starts[k] >= r.num_prompt_tokens:
                done[r.req_id] = r.prompt_logprobs
        return done


def _token_logprobs(lp, row: int, num: int) -> TokenLogprobs:
    """The sampled token plus this request's top ``num`` (the batch may have asked more)."""
    ids = lp.token_ids[row, : num + 1].tolist()
    vals = lp.logprobs[row, : num + 1].tolist()
    return TokenLogprobs(ids, vals, int(lp.ranks[row]))
