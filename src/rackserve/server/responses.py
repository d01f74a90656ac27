"""OpenAI response shapes, built as plain dicts in the exact layout OpenAI and vLLM send:
the error envelope, ``usage``, the chat and completion ``logprobs``, vLLM's
``prompt_logprobs`` and the ``created`` timestamp; and their SSE framing, encoded with
msgspec, which is fast enough for many concurrent streams on one core.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from rackserve.engine.request_output import TokenLogprob

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    return f"data: {msgspec.json.encode(payload).decode()}\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def chat_logprobs(entries: list[TokenLogprob], num_top: int) -> dict:
    """``choice.logprobs`` of a chat completion: one item per generated token."""

    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **item(e.token, e.logprob),
                "top_logprobs": [item(text, lp) for _, text, lp in e.top[:num_top]],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprob] | list[TokenLogprob | str], num_top: int, text_offset: int
) -> dict:
    """``choice.logprobs`` of a completion; the sampled token is in ``top_logprobs`` too.

    A ``str`` entry is a token without a logprob (the first prompt token when ``echo``
    scores the prompt): its logprob and top logprobs are null, as in OpenAI and vLLM."""
    offsets, offset = [], text_offset
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict | None] = []
    for e in entries:
        offsets.append(offset)
        if isinstance(e, str):
            tokens.append(e)
            token_logprobs.append(None)
            top_logprobs.append(None)
            offset += len(e)
            continue
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top = {e.token: e.logprob}
        if num_top:
            top.update({text: lp for _, text, lp in e.top[:num_top]})
        top_logprobs.append(top)
        offset += len(e.token)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def prompt_logprobs_json(entries: list[TokenLogprob | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position, {token id: {logprob, rank, token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token},
            **{
                str(t): {"logprob": lp, "rank": None, "decoded_token": text}
                for t, text, lp in e.top
                if t != e.token_id
            },
        }
        for e in entries
    ]


def now_s() -> int:
    return int(time.time())
