"""When a request stops: pure checks run after each generated token.

Two halves, because they run in different processes: the engine core checks token-level
conditions (`check_stop_token`: EOS, stop_token_ids, max_tokens, context length) right after
sampling, `check_stop_tokens` over several tokens appended at once; the API process checks
stop strings (`check_stop_strings`) on the incrementally detokenized text and aborts the
request when one matches. `check_stop` runs both, for the single-process path and tests.

A stop-string match wins over a length stop at the same token (vLLM does the same): the text
is truncated either way and "stop" tells the client why.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from rackserve.request import SamplingParams

StopKind = Literal["stop", "length"]


@dataclass(frozen=True)
class StopDecision:
    """Why a request finished.

    `kind` is the OpenAI finish_reason ("stop" or "length"). `stop_reason` is the matched
    stop string or stop token id (None for EOS and length). `text` is the output text to
    return, truncated at the stop string; None when the caller passed no text.
    """

    kind: StopKind
    stop_reason: str | int | None = None
    text: str | None = None


def check_stop_token(
    params: SamplingParams,
    last_token_id: int,
    num_output_tokens: int,
    eos_token_ids: Collection[int],
    num_tokens: int | None = None,
    max_model_len: int | None = None,
) -> StopDecision | None:
    """Token-level stop after `last_token_id` was appended (it is counted in
    `num_output_tokens`). `num_tokens` (prompt + output) and `max_model_len` bound the context.
    """
    if num_output_tokens < params.min_tokens:
        # The sampler masked EOS and stop ids until here; max_tokens >= min_tokens by validation.
        return None
    if last_token_id in eos_token_ids and not params.ignore_eos:
        return StopDecision(kind="stop")
    if last_token_id in params.stop_token_ids:
        return StopDecision(kind="stop", stop_reason=last_token_id)
    if num_output_tokens >= params.max_tokens:
        return StopDecision(kind="length")
    if num_tokens is not None and max_model_len is not None and num_tokens >= max_model_len:
        return StopDecision(kind="length")
    return None


def check_stop_tokens(
    params: SamplingParams,
    token_ids: Sequence[int],
    num_output_tokens: int,
    eos_token_ids: Collection[int],
    num_tokens: int,
    max_model_len: int,
) -> tuple[int, StopDecision] | None:
    """Token-level stop over several tokens appended at once (a step's accepted drafts, the
    first tokens a P/D prefill engine sampled), as if they were appended one by one:
    ``num_output_tokens`` and ``num_tokens`` count the tokens before the first of them.
    Returns how many are kept (up to and including the one that stops the request) and
    why, or None when none stops it."""
    for j, token in enumerate(token_ids, 1):
        # A token can only stop the request if one of these holds; the full check
        # (min_tokens, ignore_eos, which reason) runs for those few tokens only.
        if (
            token in eos_token_ids
            or token in params.stop_token_ids
            or num_output_tokens + j >= params.max_tokens
            or num_tokens + j >= max_model_len
        ):
            decision = check_stop_token(
                params,
                token,
                num_output_tokens + j,
                eos_token_ids,
                num_tokens + j,
                max_model_len,
            )
            if decision is not None:
                return j, decision
    return None


def check_stop_strings(
    params: SamplingParams, text: str, num_new_chars: int
) -> tuple[str, str] | None:
    """Find a stop string that ends inside the last `num_new_chars` characters of `text`.

    Returns (matched stop string, text truncated before it, or just after it when
    `include_stop_str_in_output`), or None. Only new text is searched: older text was
    checked when it arrived, so a match there would already have stopped the request.
    """
    if not params.stop or num_new_chars <= 0:
        return None
    earliest: tuple[int, str] | None = None
    for stop in params.stop:
        # A match ending in the new text may start up to len(stop) - 1 chars before it.
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (earliest is None or index < earliest[0]):
            earliest = (index, stop)
    if earliest is None:
        return None
    index, stop = earliest
    end = index + len(stop) if params.include_stop_str_in_output else index
    return stop, text[:end]


def stream_holdback_chars(params: SamplingParams) -> int:
    """Characters to hold back when streaming, so a stop string split over two tokens is
    never sent before it is recognised (and then removed)."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1


def check_stop(
    params: SamplingParams,
    last_token_id: int,
    num_output_tokens: int,
    eos_token_ids: Collection[int],
    text: str,
    num_new_chars: int,
    num_tokens: int | None = None,
    max_model_len: int | None = None,
) -> StopDecision | None:
    """Both checks for one appended token; `text` is the detokenized output so far and the
    last `num_new_chars` of it came from this token."""
    decision = check_stop_token(
        params, last_token_id, num_output_tokens, eos_token_ids, num_tokens, max_model_len
    )
    if decision is not None and decision.kind == "stop":
        return StopDecision(kind="stop", stop_reason=decision.stop_reason, text=text)
    if num_output_tokens >= params.min_tokens:
        match = check_stop_strings(params, text, num_new_chars)
        if match is not None:
            stop, truncated = match
            return StopDecision(kind="stop", stop_reason=stop, text=truncated)
    if decision is not None:
        return StopDecision(kind=decision.kind, stop_reason=decision.stop_reason, text=text)
    return None
