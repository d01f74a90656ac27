"""Applying a step's results (``SchedulerUpdate.update``): sampled tokens appended, token
stops checked (``engine/stop.py``), speculative drafts verified, computed KV committed to the
cache manager, finished requests freed; and a P/D request's first tokens taken from the
prefill engine's answer as if a step had sampled them (``take_first_tokens``).
"""

from __future__ import annotations

import time

from rackserve.engine.outputs import EngineCoreOutput, Logprob, RunnerOutput, SchedulerOutput
from rackserve.engine.scheduler_requests import SchedulerRequests
from rackserve.engine.stop import StopDecision, check_stop_tokens
from rackserve.request import Request, RequestStatus


def _stopped(req: Request, out: EngineCoreOutput, decision: StopDecision) -> RequestStatus:
    """The finished status a stop decision gives; its reasons go on ``out`` and ``req``."""
    status = (
        RequestStatus.FINISHED_STOPPED
        if decision.kind == "stop"
        else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    out.finish_reason = status.finish_reason.value
    out.stop_reason = req.stop_reason = decision.stop_reason
    return status


class SchedulerUpdate(SchedulerRequests):
    """``update()`` and ``take_first_tokens``; a base of ``Scheduler``."""

    def take_first_tokens(
        self, req: Request, token_ids: list[int], logprobs: list[Logprob] | None
    ) -> bool:
        """P/D decode side: the tokens the prefill engine sampled after the prompt become
        ``req``'s first output, sent with the next step's outputs as if a step had sampled
        them (stop checks included). True when they finished it (its blocks are freed)."""
        params, num_output = req.sampling_params, len(req.output_token_ids)
        if num_output or not token_ids:
            return False
        decision, max_model_len = None, self.config.max_model_len
        stop = check_stop_tokens(
            params, token_ids, num_output, self.eos_token_ids, req.num_tokens, max_model_len
        )
        if stop is not None:
            num_kept, decision = stop
            token_ids = token_ids[:num_kept]
        req.append_output_token_ids(token_ids)
        out = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=list(token_ids),
            num_cached_tokens=req.num_cached_tokens,
            first_scheduled_time=time.monotonic(),
        )
        if logprobs is not None:
            out.new_logprobs = logprobs[: len(token_ids)]
        self._finished_outputs.append(out)
        if decision is None:
            return False
        self.finish_requests([req.request_id], _stopped(req, out, decision))
        return True

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Apply sampled tokens, finish requests, commit computed KV to the cache."""
        outputs, self._finished_outputs = self._finished_outputs, []
        finished = set()
        # Hoisted: this loop runs once per request per step.
        get_request, commit, running = self.requests.get, self.kv.commit, RequestStatus.RUNNING
        idle_until = self.kv.idle_until  # every running request has an entry
        eos_token_ids, max_model_len = self.eos_token_ids, self.config.max_model_len
        eos_set = frozenset(eos_token_ids)
        all_logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        spec_tokens, new_drafts = sched.scheduled_spec_decode_tokens, result.draft_token_ids
        speculating = self.num_lookahead_tokens > 0
        for k, (req_id, sampled) in enumerate(
            zip(result.req_ids, result.sampled_token_ids, strict=True)
        ):
            req = get_request(req_id)
            if req is None or req.status != running:
                continue  # aborted or preempted while the step ran
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts:
                # rejected drafts were never computed, as far as the cache is concerned: the
                # commit below (after the accepted tokens are appended) keys only verified ones
                req.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                self._observe_drafts(len(drafts), len(sampled) - 1)
            elif req.num_computed_tokens >= idle_until[req_id]:  # else a no-op
                commit(req, req.num_computed_tokens - req.kv_commit_lag)
            if not sampled:
                continue  # a prefill chunk short of the prompt's end
            params = req.sampling_params
            decision = None
            # Counts as if the tokens were appended one by one (the stop check sees each).
            num_output, num_tokens = len(req.output_token_ids), len(req.all_token_ids)
            num_accepted = len(sampled)
            # Counts only grow with j: when none of the tokens can stop the request (the
            # usual decode step), the per-token scan (check_stop_tokens) is skipped.
            if (
                num_output + num_accepted >= params.max_tokens
                or num_tokens + num_accepted >= max_model_len
                or not eos_set.isdisjoint(sampled)
                or (params.stop_token_ids and not set(params.stop_token_ids).isdisjoint(sampled))
            ):
                stop = check_stop_tokens(
                    params, sampled, num_output, eos_token_ids, num_tokens, max_model_len
                )
                if stop is not None:
                    num_accepted, decision = stop
            # The runner hands its lists over (as vLLM's does): no copy unless cut at a stop.
            accepted = sampled if num_accepted == len(sampled) else sampled[:num_accepted]
            req.append_output_token_ids(accepted)
            if drafts:  # cut at a stop: the tokens past it are not the request's
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                if req.num_computed_tokens >= idle_until[req_id]:
                    commit(req, req.num_computed_tokens)
            if speculating:
                req.spec_token_ids = new_drafts.get(req_id, [])
            out = EngineCoreOutput(
                request_id=req_id, new_token_ids=accepted, num_cached_tokens=req.num_cached_tokens
            )
            if len(req.output_token_ids) == num_accepted:  # its first tokens: when it started
                out.first_scheduled_time = req.first_scheduled_time
            if all_logprobs is not None and all_logprobs[k]:
                out.new_logprobs = [
                    Logprob(lp.token_ids, lp.logprobs, lp.rank)
                    for lp in all_logprobs[k][:num_accepted]
                ]
            if prompt_logprobs and req_id in prompt_logprobs and num_output == 0:
                out.prompt_logprobs = [
                    None if lp is None else Logprob(lp.token_ids, lp.logprobs, lp.rank)
                    for lp in prompt_logprobs[req_id]
                ]
            if decision is not None:
                finished.add(req_id)
                self._free(req, _stopped(req, out, decision))
            outputs.append(out)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return outputs

    def _observe_drafts(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert self.spec_stats is not None, "drafts were scheduled without num_spec_tokens"
        self.spec_stats.observe(num_draft_tokens, num_accepted)
