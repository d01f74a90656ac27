"""What a client request's output looks like (vLLM's shapes): a ``RequestOutput`` per
client request with one ``CompletionOutput`` per completion (``n``), its ``TokenLogprob``
entries, and the ``RequestOutputKind`` that says whether each carries the news, everything
so far, or only the final state. ``engine/output_processor.py`` makes them; the API server
and the offline ``LLM`` read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """What each RequestOutput carries: only new text/tokens (streaming), everything so far,
    or one output when the request finished (offline generate)."""

    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class TokenLogprob:
    """One generated (or prompt) position: the chosen token and the top alternatives."""

    token_id: int
    token: str  # decoded text of the token
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, str, float]]  # (token id, decoded text, logprob), best first


@dataclass
class CompletionOutput:
    """One of the n completions of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state (or, in DELTA mode, the news) of one client request (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
