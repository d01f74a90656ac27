"""What one request may ask of a shared server, checked before any tokenization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rackserve.server.protocol import ParamError


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits (``rackserve serve`` flags). A request over a limit is a 400 whose
    ``code`` names the limit; /metrics counts them in ``request_rejected{reason}``."""

    max_sequences_per_request: int = 256  # prompts x n
    max_tokens_per_request: int | None = None  # None: up to the context length
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if self.max_sequences_per_request < 1:
            raise ValueError("--max-sequences-per-request must be at least 1")
        if self.max_tokens_per_request is not None and self.max_tokens_per_request < 1:
            raise ValueError("--max-tokens-per-request must be at least 1")

    def check(self, body: Any, num_prompts: int, vocab_size: int) -> None:
        """ParamError for a request (a parsed completion or chat body) over a limit."""
        num_sequences = num_prompts * body.n
        if num_sequences > self.max_sequences_per_request:
            raise ParamError(
                f"this request asks for {num_sequences} sequences ({num_prompts} prompts x "
                f"n={body.n}); this server allows at most {self.max_sequences_per_request} "
                "per request",
                "n",
                code="too_many_sequences",
            )
        cap = self.max_tokens_per_request
        requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if cap is not None and requested is not None and requested > cap:
            raise ParamError(
                f"max_tokens is {requested}; this server allows at most {cap} per request",
                "max_tokens",
                code="max_tokens_limit",
            )
        if body.top_k is not None and body.top_k > vocab_size:
            raise ParamError(
                f"top_k must be at most the vocabulary size {vocab_size} (0 or -1 = off), "
                f"got {body.top_k}",
                "top_k",
            )
