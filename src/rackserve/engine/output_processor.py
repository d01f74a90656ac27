"""The frontend's per-request state: token ids from the engine core -> text for clients.

Shared by the API server (streaming deltas) and the offline ``LLM`` (final outputs). It is
synchronous and knows no transport: the caller sends what ``add_request`` returns to the
core, feeds every ``EngineCoreOutputs`` to ``process_outputs``, aborts the ids it returns
and sends the follow-up requests it returns.

    add_request(parent) -> [child 0]                    (n > 1: children 1..n-1 wait)
    process_outputs(outputs) -> RequestOutputs, ids to abort (stop strings),
                                children to send now (child 0 has its first token, so its
                                prompt is in the prefix cache for them)

Per token it detokenizes incrementally (``engine/detokenizer.py``), checks stop strings
(``engine/stop.py``), collects logprobs, and records the timings that the metrics need. The
``RequestOutput``s it returns have vLLM's shapes (``engine/request_output.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from rackserve.engine.detokenizer import Detokenizer, special_token_ids
from rackserve.engine.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, Logprob
from rackserve.engine.request_output import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    TokenLogprob,
)
from rackserve.engine.stop import check_stop_strings, stream_holdback_chars
from rackserve.request import FinishReason, SamplingParams, child_seed

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    """Timings of one finished engine request (a child, for n > 1), for the metrics."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float
    # phases for vLLM's histograms (0 when the request never got a token)
    prefill_time_s: float = 0.0  # first scheduled -> first token
    decode_time_s: float = 0.0  # first token -> last token


@dataclass
class IterationStats:
    """What one ``process_outputs`` call saw, for the metrics."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived
    num_cached_prompt_tokens: int = 0  # of those, tokens served from the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    # first-token step start - arrival: exact when the prompt was prefilled in one step
    queue_times_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    abort_ids: list[str]  # engine request ids to abort (stopped by a stop string)
    to_send: list[EngineCoreRequest]  # children released by their sibling's first token
    stats: IterationStats
    # client requests whose outputs could not be processed: (request id, message); already
    # forgotten here, their engine requests are in abort_ids. The others are unaffected.
    failed: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Child:
    """One engine request: a completion of its parent."""

    index: int
    request_id: str
    params: SamplingParams
    detokenizer: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    text: str = ""  # final text (after stop-string truncation); detokenizer.text before
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    arrival_time: float
    children: list[_Child]
    pending: list[EngineCoreRequest]  # children 1..n-1, sent after child 0's first token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(child.finished for child in self.children)


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


class OutputProcessor:
    """All in-flight requests of one frontend; see the module docstring for the protocol."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a client request; returns the engine requests to send now."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in flight")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        children, requests = [], []
        for i in range(n):
            child_id = request_id if n == 1 else child_request_id(i, request_id)
            child_params = params
            if n > 1:
                seed = None if params.seed is None else child_seed(params.seed, i)
                child_params = replace(params, n=1, seed=seed)
            detokenizer = Detokenizer(
                self.tokenizer, prompt_token_ids, child_params.skip_special_tokens, self.special_ids
            )
            logprobs = [] if child_params.logprobs is not None else None
            children.append(_Child(i, child_id, child_params, detokenizer, logprobs=logprobs))
            if logprobs is not None:
                children[-1].cumulative_logprob = 0.0
            requests.append(
                EngineCoreRequest(
                    child_id, list(prompt_token_ids), child_params, arrival, priority, cache_salt
                )
            )
        parent = _Parent(
            request_id, prompt, list(prompt_token_ids), kind, arrival, children, requests[1:]
        )
        self._parents[request_id] = parent
        for child in children:
            self._children[child.request_id] = (parent, child)
        return requests[:1]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a client request; returns the engine request ids to abort in the core."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        unsent = {r.request_id for r in parent.pending}
        for child in parent.children:
            self._children.pop(child.request_id, None)
        return [
            c.request_id for c in parent.children if not c.finished and c.request_id not in unsent
        ]

    def abort_all(self) -> list[str]:
        """Forget every client request; returns the engine request ids to abort."""
        return [i for request_id in list(self._parents) for i in self.abort_request(request_id)]

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def parent_id(self, engine_request_id: str) -> str | None:
        """The client request an engine request (a child, for n > 1) belongs to."""
        entry = self._children.get(engine_request_id)
        return None if entry is None else entry[0].request_id

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- outputs -------------------------------------------------------------------------
    def process_outputs(
        self,
        outputs: EngineCoreOutputs | Iterable[EngineCoreOutput],
        now: float | None = None,
        step_start: float | None = None,
    ) -> ProcessedOutputs:
        """Apply one batch of engine outputs; see ``ProcessedOutputs``.

        ``step_start`` (``time.monotonic()`` when the step that produced the outputs
        started; the engine process sends it) gives each request's queue time."""
        now = time.monotonic() if now is None else now
        items = outputs.outputs if isinstance(outputs, EngineCoreOutputs) else outputs
        stats = IterationStats()
        abort_ids: list[str] = []
        to_send: list[EngineCoreRequest] = []
        changed: dict[str, tuple[_Parent, list[_Child]]] = {}
        failed: list[tuple[str, str]] = []
        for output in items:
            entry = self._children.get(output.request_id)
            if entry is None or entry[1].finished:
                continue  # aborted, or stopped by a stop string while tokens were in flight
            parent, child = entry
            try:
                stopped = self._update_child(parent, child, output, now, step_start, stats)
            except Exception as e:  # one request's bad output must not take the others down
                logger.exception("processing the output of request %s failed", parent.request_id)
                failed.append((parent.request_id, f"output processing failed: {e!r}"))
                abort_ids.extend(self.abort_request(parent.request_id))
                changed.pop(parent.request_id, None)
                continue
            if stopped:
                abort_ids.append(child.request_id)
            if child.index == 0 and parent.pending and (child.token_ids or child.finished):
                to_send.extend(parent.pending)
                parent.pending = []
            changed.setdefault(parent.request_id, (parent, []))[1].append(child)
        if failed:  # children a failed request released this step: never sent, so not aborted
            unsent = {r.request_id for r in to_send} & set(abort_ids)
            to_send = [r for r in to_send if r.request_id not in unsent]
            abort_ids = [i for i in abort_ids if i not in unsent]
        request_outputs = []
        for parent, children in changed.values():
            request_output = self._make_output(parent, children)
            if request_output is not None:
                request_outputs.append(request_output)
            if parent.finished:
                self._parents.pop(parent.request_id, None)
                for child in parent.children:
                    self._children.pop(child.request_id, None)
        return ProcessedOutputs(request_outputs, abort_ids, to_send, stats, failed)

    def _update_child(
        self,
        parent: _Parent,
        child: _Child,
        output: EngineCoreOutput,
        now: float,
        step_start: float | None,
        stats: IterationStats,
    ) -> bool:
        """Append one output's tokens; returns True if a stop string ended the request, so
        the core must abort it."""
        params = child.params
        if child.index == 0 and output.num_cached_tokens:
            parent.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None and child.index == 0:
            parent.prompt_logprobs = [
                None if lp is None else self._logprob_entry(lp) for lp in output.prompt_logprobs
            ]
        new_token_ids = output.new_token_ids
        if new_token_ids:
            if child.first_token_time is None:
                stats.time_to_first_tokens_s.append(now - parent.arrival_time)
                started = output.first_scheduled_time or step_start
                if started is not None:
                    stats.queue_times_s.append(max(started - parent.arrival_time, 0.0))
                    child.first_scheduled_time = started
                stats.num_prompt_tokens += len(parent.prompt_token_ids)
                stats.num_cached_prompt_tokens += output.num_cached_tokens
                child.first_token_time = now
            else:
                stats.inter_token_latencies_s.append(now - (child.last_token_time or now))
            child.last_token_time = now
            stats.num_generation_tokens += len(new_token_ids)
        # An EOS or stop token ends the text without being part of it (unless asked for).
        skip_last = (
            output.finish_reason == FinishReason.STOP
            and not isinstance(output.stop_reason, str)
            and not params.include_stop_str_in_output
        )
        stopped_by_string = False
        for j, token_id in enumerate(new_token_ids):
            child.token_ids.append(token_id)
            if child.logprobs is not None and output.new_logprobs is not None:
                entry = self._logprob_entry(output.new_logprobs[j])
                child.logprobs.append(entry)
                child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry.logprob
            if skip_last and j == len(new_token_ids) - 1:
                break
            new_text = child.detokenizer.append(token_id)
            if len(child.token_ids) < params.min_tokens:
                continue
            match = check_stop_strings(params, child.detokenizer.text, len(new_text))
            if match is not None:
                child.finish_reason, child.stop_reason = FinishReason.STOP.value, match[0]
                child.text = match[1]
                stopped_by_string = True
                break
        if not stopped_by_string:
            child.text = child.detokenizer.text
            if output.finish_reason is not None:
                child.finish_reason = str(output.finish_reason)
                child.stop_reason = output.stop_reason
        if child.finished:
            first, last = child.first_token_time, child.last_token_time
            scheduled = child.first_scheduled_time
            stats.finished.append(
                FinishedRequestStats(
                    child.finish_reason or FinishReason.ABORT.value,
                    len(parent.prompt_token_ids),
                    len(child.token_ids),
                    now - parent.arrival_time,
                    0.0 if first is None or scheduled is None else max(first - scheduled, 0.0),
                    0.0 if first is None or last is None else last - first,
                )
            )
        # A stop string found while the core still runs the request: it must be aborted.
        return stopped_by_string and output.finish_reason is None

    def _logprob_entry(self, logprob: Logprob) -> TokenLogprob:
        decode = self._decode_token
        top = [
            (token_id, decode(token_id), value)
            for token_id, value in zip(logprob.token_ids[1:], logprob.logprobs[1:], strict=True)
        ]
        token_id = logprob.token_ids[0]
        return TokenLogprob(token_id, decode(token_id), logprob.logprobs[0], logprob.rank, top)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _make_output(self, parent: _Parent, children: list[_Child]) -> RequestOutput | None:
        kind = parent.kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            children = parent.children
        elif kind == RequestOutputKind.CUMULATIVE:
            children = parent.children
        completions = [self._completion(child, kind) for child in children]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=sorted(completions, key=lambda c: c.index),
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _completion(self, child: _Child, kind: RequestOutputKind) -> CompletionOutput:
        text = child.text
        if not child.finished and kind != RequestOutputKind.FINAL_ONLY:
            # Hold back the characters that could be the start of a stop string.
            holdback = stream_holdback_chars(child.params)
            text = text[: max(len(text) - holdback, child.num_sent_chars)]
        token_ids, logprobs = child.token_ids, child.logprobs
        if kind == RequestOutputKind.DELTA:
            text = text[child.num_sent_chars :]
            token_ids = token_ids[child.num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[child.num_sent_tokens :]
            child.num_sent_chars += len(text)
            child.num_sent_tokens = len(child.token_ids)
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=child.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )
