"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the cache tensors and per-request state (token ids, block tables, sampling rows) and
makes no policy: it computes exactly the tokens it was granted. A uniform decode step
replays a captured CUDA graph (``cuda_graph.py``) and samples inside the graphs when its
sampling allows (``graph_sampling.py``); a prefill / mixed step of up to 2048 tokens replays
one too (``PrefillGraphs``) and samples after it; other steps run the same forward eagerly.
Nothing waits for the device before the sampled token ids are read back.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from rackserve.config import SpecConfig
from rackserve.device import PinnedStaging
from rackserve.engine.async_scheduling import InlineDevice
from rackserve.engine.outputs import RunnerOutput, SchedulerOutput, TokenLogprobs
from rackserve.engine.step_phases import phase, phased
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import KVCacheTensors
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.request import SamplingParams
from rackserve.runner.cuda_graph import (
    DecodeGraphs,
    PrefillGraphs,
    capture_step_graphs,
    context_buckets,
    graph_batch_sizes,
)
from rackserve.runner.graph_sampling import in_graph_sampling
from rackserve.runner.input_batch import InputBatch, PreparedStep, RunnerRequest
from rackserve.runner.inputs import StepInputs, ring_widths
from rackserve.runner.logits_processors import apply_logits_processors
from rackserve.runner.prompt_logprobs import accumulate_prompt_logprobs, needs_every_row
from rackserve.runner.sampler import SamplerOutput, sample
from rackserve.runner.step_buffers import Feed, StepBuffers
from rackserve.runner.step_handle import (
    DeviceStep,
    StepHandle,
    StepTimer,
    feeder,
    output_to_host,
    sampled_ids,
    to_host,
)
from rackserve.runner.structured_output import GrammarCompiler, StructuredOutputs
from rackserve.spec_decode.checkpoint import DRAFT_PREFIX
from rackserve.spec_decode.drafters import build_proposer
from rackserve.spec_decode.proposer import Proposer, VerifiedStep, VerifyOutputs
from rackserve.spec_decode.verify import accept_drafts


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
        enforce_eager: bool = False,
        log: bool = True,
        grammar_compiler: GrammarCompiler | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        speculative: SpecConfig | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """``grammar_compiler``: compiles structured-output grammars (None: requests with
        ``structured_outputs`` are not expected; the engine core refuses them).
        ``kv_cache_dtype``: the KV groups' storage (None: the model dtype).
        ``speculative``: the drafter (``groups`` then holds its cache groups too, in the KV
        manager's order; see spec_decode/proposer.py). ``max_num_batched_tokens``: the most
        tokens one request gets in a step (None: max_model_len); it sizes the sliding
        groups' block-table rings."""
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.head.weight.dtype
        self.caches = KVCacheTensors(groups, num_blocks, self.dtype, self.device, kv_cache_dtype)
        # the chained drafts write up to K positions past a step's tokens (lookahead)
        lookahead = 0 if speculative is None else 2 * speculative.num_speculative_tokens + 1
        max_step_tokens = min(max_num_batched_tokens or max_model_len, max_model_len)
        self.input_batch = InputBatch(
            {g.name: g.block_tokens for g in groups},
            max_num_reqs,
            max_model_len + lookahead,
            model.cfg.vocab_size,
            eos_token_ids,
            self.device,
            seed,  # draws the noise seeds of unseeded random requests
            ring_widths(groups, max_step_tokens + lookahead),
            max_step_tokens,
        )
        target_groups = [g for g in groups if not g.name.startswith(DRAFT_PREFIX)]
        self.buffers = StepBuffers(target_groups, self.input_batch.block_tables, self.device)
        self._feed_staging = PinnedStaging(self.device)  # the feeds' index pairs
        self.proposer: Proposer | None = None
        if speculative is not None:
            self.proposer = build_proposer(
                speculative, model, self.caches, groups, self.buffers.tables
            )
        self.structured_outputs = (
            None
            if grammar_compiler is None
            else StructuredOutputs(
                grammar_compiler, max_num_reqs, model.cfg.vocab_size, self.device
            )
        )
        cfg = model.cfg
        self.expert_counts = torch.zeros(
            cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64, device=self.device
        )
        # where launched steps run (engine/async_scheduling.py: a fake delayed one in tests)
        self.device_queue = InlineDevice()
        self._launched: StepHandle | None = None  # launched, not collected yet
        # Drafts proposed on the device (Proposer.propose_verified): the scheduler holds
        # placeholders; request -> (the step that proposed them, its row there)
        self._proposed: dict[str, tuple[DeviceStep, int]] = {}
        self._last_collected: DeviceStep | None = None
        # a token still in flight: past the vocabulary, so the penalties' padding ignores it
        self.placeholder = cfg.vocab_size
        self.graphs: DecodeGraphs | None = None
        # Speculating, a verify step is not a uniform decode step and MTP reads the streams:
        # the drafter's own graphs (spec_decode/graphs.py) serve uniform verify steps.
        if self.device.type == "cuda" and not enforce_eager and self.proposer is not None:
            self.proposer.enable_graphs(
                model,
                self.caches,
                self.buffers,
                target_groups,
                graph_batch_sizes(max_num_reqs),
                context_buckets(max_model_len + lookahead),
                log=log,
            )
        self.prefill_graphs: PrefillGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager and speculative is None:
            self.prefill_graphs, self.graphs = capture_step_graphs(
                model, self.caches, self.buffers, groups, max_num_reqs, max_model_len,
                max_step_tokens, log,
            )  # fmt: skip

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step, start to end (the synchronous engine)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """The host half of a step (deltas, inputs, sampling tensors), then its device work
        on :attr:`device` (a GPU: enqueued on the stream; the CPU: run now). A request
        whose last token is still in flight (async scheduling: the step launched before
        this one, not collected yet) gets a placeholder, replaced on the device by that
        step's sampled id; so do drafts the last step proposed on the device."""
        prepared = self._prepare(sched)
        if prepared is None:
            return StepHandle(None, None)
        step, feed, feed_outputs = prepared
        with phase("enqueue"):
            handle = StepHandle(
                step, self.device_queue.submit(lambda: self._run(step, feed, feed_outputs))
            )
        handle.sample_index = {r.req_id: j for j, r in enumerate(step.sampled_reqs)}
        self._launched = handle
        return handle

    @phased("prepare")
    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[PreparedStep, Feed | None, Feed | None] | None:
        """The step's host inputs and, under async scheduling, the feeds of the in-flight
        tokens into its input ids and penalties' output ids; None: nothing to run."""
        structured = self.structured_outputs
        if structured is not None:
            structured.update(sched)
        fed = self._add_placeholders(sched) if self._launched is not None else []
        pending = self._take_drafts(sched) if self._proposed else []
        step = self.input_batch.prepare(sched)
        if step is None:
            return None
        feed = feed_outputs = None
        if pending:  # (no async scheduling while speculating: no ``fed`` then)
            feed = self._drafts_feeder(step, pending)
        if fed:
            prev = self._launched
            assert prev is not None and prev.step is not None
            starts = step.inputs.query_start_loc
            at = {r.req_id: k for k, r in enumerate(step.reqs)}
            sources = np.array([prev.sample_index[i] for i in fed], dtype=np.int64)
            index = np.array([starts[at[i]] for i in fed], dtype=np.int64)
            feed = feeder(sampled_ids(prev.future), index, sources, self._feed_staging)
            feed_outputs = self._output_ids_feeder(step, fed, prev.future, sources)
        return step, feed, feed_outputs

    def _take_drafts(self, sched: SchedulerOutput) -> list[tuple[str, DeviceStep, int, int]]:
        """Scheduled drafts that are placeholders (proposed on the device, ``_proposed``):
        those of the last collected step stay there, fed into this step's input ids and
        read when it is collected (``PreparedStep.pending_drafts``); older ones have landed
        on the host, and their values replace the placeholders here."""
        spec = sched.scheduled_spec_decode_tokens
        pending = []
        for req_id, drafts in spec.items():
            source = self._proposed.pop(req_id, None)
            if source is None:  # proposed on the host: real ids already
                continue
            result, row = source
            if result is self._last_collected:
                pending.append((req_id, result, row, len(drafts)))
            else:
                spec[req_id] = result.drafts_on_host(row, len(drafts))
        return pending

    def _drafts_feeder(
        self, step: PreparedStep, pending: list[tuple[str, DeviceStep, int, int]]
    ) -> Feed:
        """The feed of ``pending`` drafts (one source step's) into ``step``'s input ids, each
        request's after its first token; ``step.pending_drafts`` keeps what its collect
        reads back."""
        source = pending[0][1]
        assert source.device_drafts is not None and all(p[1] is source for p in pending)
        width = source.device_drafts.shape[1]
        starts = step.inputs.query_start_loc
        at = {r.req_id: k for k, r in enumerate(step.reqs)}
        index, rows = [], []
        for req_id, _, row, num in pending:
            k = at[req_id]
            index.extend(range(starts[k] + 1, starts[k] + 1 + num))
            rows.extend(range(row * width, row * width + num))
            step.pending_drafts.append((k, row, num))
        step.drafts_source = source
        drafts = source.device_drafts
        return feeder(
            lambda: drafts.reshape(-1), np.array(index, dtype=np.int64),
            np.array(rows, dtype=np.int64), self._feed_staging,
        )  # fmt: skip

    def _add_placeholders(self, sched: SchedulerOutput) -> list[str]:
        """Requests scheduled at a token the host does not know yet (computed == known):
        PLACEHOLDER joins their token list (lengths, positions, min_tokens stay right)."""
        fed = []
        requests = self.input_batch.requests
        cached = sched.cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            r = requests.get(req_id)
            if r is not None and computed == len(r.token_ids):
                r.token_ids.append(self.placeholder)
                fed.append(req_id)
        return fed

    def _output_ids_feeder(
        self, step: PreparedStep, fed: list[str], prev: Future | None, sources: np.ndarray
    ) -> Feed | None:
        """For a step whose penalties read the output tokens: writes the in-flight tokens of
        ``fed`` (the previous step's rows ``sources``) over their placeholders, each its
        request's last output token, in the sampling tensors' [R, L] output ids."""
        sampling = step.sampling
        if sampling is None or sampling.output_token_ids is None:
            return None
        width = sampling.output_token_ids.shape[1]
        at = {r.req_id: (j, r) for j, r in enumerate(step.sampled_reqs)}
        index = [j * width + len(r.output_token_ids) - 1 for j, r in (at[i] for i in fed)]
        index_array = np.array(index, dtype=np.int64)
        return feeder(sampled_ids(prev), index_array, sources, self._feed_staging)

    def _run(
        self,
        step: PreparedStep,
        feed: Feed | None,
        feed_outputs: Feed | None = None,
    ) -> DeviceStep:
        """The device work of a step: forward, logits processors, sampling (inside the
        decode graphs when the step allows), the copy of the sampled ids to the host (an
        event marks it on a GPU). ``feed_outputs``: the in-flight tokens into the
        penalties' output ids (async scheduling)."""
        with torch.inference_mode():
            timer = StepTimer(self.device)
            reqs, inputs = step.reqs, step.inputs
            key = self.graphs.key_for(inputs) if self.graphs is not None else None
            verify_graphs = self.proposer.graphs if self.proposer is not None else None
            verify_key = None
            if verify_graphs is not None:
                verify_key = verify_graphs.key_for(inputs, step.num_draft_tokens)
            # rows per sampled request: 1, or 1 + drafts for a verify step
            num_rows = [m + 1 for m in step.num_draft_tokens] or [1] * len(step.sampled_reqs)
            row_params = [
                r.sampling_params
                for r, n in zip(step.sampled_reqs, num_rows, strict=True)
                for _ in range(n)
            ]
            prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
            streams: torch.Tensor | None = None  # [T, N, D] final streams (eager, verify graphs)
            token_ids = None  # [S'] sampled inside the decode graphs
            if key is not None:
                in_graph = in_graph_sampling(step.sampling, row_params)
                decoded = self.graphs.run(key, inputs, step.table_writes, feed, in_graph)
                logits, token_ids = decoded.logits, decoded.token_ids
                expert_counts = decoded.expert_counts
            elif verify_key is not None:
                assert verify_graphs is not None
                logits, streams, expert_counts = verify_graphs.run(
                    verify_key, inputs, step.table_writes, feed
                )
            else:
                # every row's hidden state where a request computes its prompt's logprobs
                # (eagerly); else the hyper head runs on the rows that need logits only
                all_rows = needs_every_row(reqs, inputs.num_computed_tokens)
                graphs = None if all_rows else self.prefill_graphs
                prefill_key = graphs.key_for(inputs) if graphs is not None else None
                if prefill_key is not None:  # a prefill / mixed step from its graph
                    assert graphs is not None
                    sampled, expert_counts = graphs.run(
                        prefill_key, inputs, step.table_writes, feed
                    )
                else:
                    input_ids, meta, logits_indices = self.buffers.eager_step(
                        inputs, step.table_writes
                    )
                    if feed is not None:
                        feed(input_ids)
                    expert_counts = self.expert_counts.zero_()
                    head_rows = None if all_rows else logits_indices
                    hidden, streams = self.model(
                        input_ids, meta, self.caches, expert_counts, head_rows
                    )
                    sampled = hidden if head_rows is not None else hidden[logits_indices]
                if all_rows:
                    prompt_logprobs = accumulate_prompt_logprobs(
                        self.model.compute_logits, reqs, inputs.query_start_loc,
                        inputs.num_computed_tokens, hidden,
                    )  # fmt: skip
                logits = self.model.compute_logits(sampled)  # [S', V]
            if token_ids is not None:  # graph-safe sampling asks no logprobs
                out = SamplerOutput(token_ids, logprobs=None)
            else:
                if feed_outputs is not None:
                    assert step.sampling is not None and step.sampling.output_token_ids is not None
                    feed_outputs(step.sampling.output_token_ids.view(-1))
                out = self._sample(step, logits, row_params, num_rows)
            host_ids = None if out is None else to_host(out.token_ids)
            result = DeviceStep(
                out=None if out is None else output_to_host(out),
                host_token_ids=host_ids,
                device_token_ids=None if out is None else out.token_ids,
                num_rows=num_rows,
                prompt_logprobs=prompt_logprobs,
                expert_counts=expert_counts.clone(),  # the static buffer is reused next step
                streams=streams,
                timer=timer.stop(),  # the collect waits for this, not for the proposal
            )
            if verify_key is not None and out is not None:
                self._propose_verified(result, step, verify_key, out.token_ids, row_params)
            return result

    def _propose_verified(
        self,
        result: DeviceStep,
        step: PreparedStep,
        key: tuple[int, int],
        target_ids: torch.Tensor,
        row_params: list[SamplingParams],
    ) -> None:
        """Enqueue the next drafts [R, K] right behind a uniform verify step (graph ``key``)
        whose requests all draft greedily (``Proposer.propose_verified``) into ``result``;
        else leave them to the collect, after the read-back."""
        proposer = self.proposer
        assert proposer is not None and proposer.graphs is not None
        assert result.streams is not None
        if not all(p.is_greedy for p in row_params):
            return
        # the next step samples before the drafts' ids reach the host: penalties, which
        # read them there, wait for the host's proposal
        if step.sampling is None or step.sampling.output_token_ids is not None:
            return
        num = len(step.reqs)
        ids, positions = proposer.graphs.staged(key, num)
        inputs = step.inputs
        verified = VerifyOutputs(
            ids, positions, target_ids.view(num, -1), result.streams, inputs.rows,
            inputs.max_seq_len + proposer.num_tokens,
        )  # fmt: skip
        timer = StepTimer(self.device)
        drafts = proposer.propose_verified(verified)
        if drafts is not None:
            result.device_drafts, result.host_drafts = drafts, to_host(drafts)
            result.proposal = timer.stop()

    def _sample(
        self,
        step: PreparedStep,
        logits: torch.Tensor,
        row_params: list[SamplingParams],
        num_rows: list[int],
    ) -> SamplerOutput | None:
        """Eager sampling after the forward: the logits processors, then ``sample`` (with
        the drafts' rejection rule when verifying). logits: [S', V]; None when no request
        samples (prefill chunks only)."""
        sampled_reqs = step.sampled_reqs
        # hook (issue 15): logit_bias and structured output, runner/logits_processors.py;
        # the grammar masks are filled on the host while the device runs the forward
        structured = self.structured_outputs
        bitmask = structured.bitmask(sampled_reqs) if structured is not None else None
        if bitmask is not None and len(row_params) > len(sampled_reqs):
            repeats = torch.tensor(num_rows, device=bitmask.device)
            bitmask = bitmask.repeat_interleave(repeats, dim=0)
        logits = apply_logits_processors(logits, row_params, bitmask)
        if step.sampling is None:
            return None
        resample = None  # sampled drafts: the rejection rule (spec_decode/verify.py)
        if self.proposer is not None:
            resample = self.proposer.resampler(sampled_reqs, num_rows, step.sampling)
        return sample(logits, step.sampling, resample)

    @torch.inference_mode()
    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step's sampled ids (by event on a GPU) and apply them."""
        if handle is self._launched:
            self._launched = None
        step = handle.step
        if step is None or handle.future is None:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        res = handle.future.result()
        reqs, inputs = step.reqs, step.inputs
        sampled: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[TokenLogprobs]] | None = None
        starts = inputs.query_start_loc
        num_kept = [starts[k + 1] - starts[k] for k in range(len(reqs))]  # verify: fewer
        if res.out is not None:
            assert res.host_token_ids is not None
            with phase("wait"):
                token_ids = res.timer.wait_for(res.host_token_ids).tolist()
            source = step.drafts_source
            for k, row, num in step.pending_drafts:  # fed on the device: their ids now
                assert source is not None
                reqs[k].token_ids[-num:] = source.drafts_on_host(row, num)
            with phase("emit"):
                logprobs = self._emit(
                    reqs, inputs, res.num_rows, res.out, token_ids, sampled, num_kept
                )
            structured = self.structured_outputs
            if structured is not None:  # constrained requests never draft: one token each
                structured.advance(step.sampled_reqs, [sampled[k][-1] for k in _sampled(inputs)])
        drafts: dict[str, list[int]] = {}
        if self.proposer is not None:
            with phase("propose"):
                drafts = self._drafts(reqs, inputs, num_kept, sampled, res, step)
        last = self._last_collected
        # the last step's proposal on the device ran before this step's forward: done now
        propose_time_s = last.proposal.elapsed_s() if last and last.proposal else 0.0
        self._last_collected = res
        return RunnerOutput(
            req_ids=[r.req_id for r in reqs],
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=res.prompt_logprobs,
            expert_counts=res.expert_counts,
            forward_time_s=res.timer.elapsed_s(),  # ends at the token read-back
            draft_token_ids=drafts,
            propose_time_s=propose_time_s,
        )

    def _drafts(
        self,
        reqs: list[RunnerRequest],
        inputs: StepInputs,
        num_kept: list[int],
        sampled: list[list[int]],
        res: DeviceStep,
        step: PreparedStep,
    ) -> dict[str, list[int]]:
        """The next step's drafts for the scheduler. Proposed on the device (still running
        there): placeholders, each request's source kept in ``_proposed`` for the next
        launch. Else proposed here, after the read-back."""
        proposed = self._proposed
        if res.device_drafts is None:
            for r in reqs:
                proposed.pop(r.req_id, None)
            return self._propose(reqs, inputs, num_kept, sampled, res.streams, step, res.num_rows)
        if len(proposed) > len(self.input_batch.requests):  # finished with drafts pending
            for req_id in proposed.keys() - self.input_batch.requests.keys():
                del proposed[req_id]
        num = res.device_drafts.shape[1]
        drafts = {}
        for row, r in enumerate(reqs):
            proposed[r.req_id] = (res, row)
            drafts[r.req_id] = [self.placeholder] * num
        return drafts

    @staticmethod
    def _emit(
        reqs: list[RunnerRequest],
        inputs: StepInputs,
        num_rows: list[int],
        out: SamplerOutput,
        token_ids: list[int],
        sampled: list[list[int]],
        num_kept: list[int],
    ) -> list[list[TokenLogprobs]] | None:
        """Each sampled request's tokens into ``sampled`` (and its token list): the one
        sampled token, or for a verify step (rows 1 + drafts) the accepted drafts and one
        more; ``num_kept`` loses the rejected ones. Returns the logprobs of those tokens."""
        logprobs: list[list[TokenLogprobs]] | None = None
        if out.logprobs is not None:
            logprobs = [[] for _ in reqs]
        first = 0  # the request's first logits row
        starts = inputs.query_start_loc
        for k, n in zip(_sampled(inputs), num_rows, strict=True):
            req = reqs[k]
            emitted = [token_ids[first]]
            if n > 1:
                drafts = req.token_ids[-(n - 1) :]
                del req.token_ids[-(n - 1) :]  # prepare() appended them for the inputs
                emitted = accept_drafts(token_ids[first : first + n], drafts)
                num_kept[k] -= n - len(emitted)
            at = inputs.num_computed_tokens[k] + starts[k + 1] - starts[k]  # its index
            if n == 1 and at < len(req.token_ids):  # async: a placeholder holds its place
                req.token_ids[at] = emitted[0]
            else:
                req.token_ids.extend(emitted)
            sampled[k] = emitted
            num = req.sampling_params.logprobs
            if logprobs is not None and num is not None:
                assert out.logprobs is not None
                logprobs[k] = [
                    _token_logprobs(out.logprobs, first + j, num) for j in range(len(emitted))
                ]
            first += n
        return logprobs

    def _propose(
        self,
        reqs: list[RunnerRequest],
        inputs: StepInputs,
        num_kept: list[int],
        sampled: list[list[int]],
        streams: torch.Tensor | None,
        prepared: PreparedStep,
        num_rows: list[int],
    ) -> dict[str, list[int]]:
        """The next step's drafts of every request that sampled and may speculate
        (``num_rows``: logits rows per sampled request)."""
        assert self.proposer is not None and streams is not None  # no decode graphs then
        wants = [
            bool(s) and r.sampling_params.structured_outputs is None
            for r, s in zip(reqs, sampled, strict=True)
        ]
        step = VerifiedStep(
            token_ids=[r.token_ids for r in reqs],
            num_computed=inputs.num_computed_tokens,
            num_kept=num_kept,
            sampled=[bool(s) for s in sampled],
            wants_draft=wants,
            rows=inputs.rows,
            query_start_loc=inputs.query_start_loc,
            streams=streams,
            req_ids=[r.req_id for r in reqs],
            is_greedy=[r.sampling_params.is_greedy for r in reqs],
            sampling=prepared.sampling,
            num_rows=num_rows,
        )
        proposals = self.proposer.propose(step)
        return {r.req_id: p for r, p, w in zip(reqs, proposals, wants, strict=True) if w}


def _sampled(inputs: StepInputs) -> list[int]:
    return [k for k, needs in enumerate(inputs.sample_mask) if needs]


def _token_logprobs(lp, row: int, num: int) -> TokenLogprobs:
    """The sampled token plus this request's top ``num`` (the batch may have asked more)."""
    ids = lp.token_ids[row, : num + 1].tolist()
    vals = lp.logprobs[row, : num + 1].tolist()
    return TokenLogprobs(ids, vals, int(lp.ranks[row]))
