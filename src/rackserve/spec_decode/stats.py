"""Acceptance counters of speculative decoding (cumulative, as vLLM names them)."""

from __future__ import annotations

import msgspec


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Cumulative over the engine's life. A draft = one request's verified run of drafts.

    ``num_accepted_tokens_per_pos[i]``: drafts whose token i (0-based) was accepted.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verify step: it proposed ``num_draft_tokens``, kept the first
        ``num_accepted_tokens``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < self.num_spec_tokens:
            per_pos.extend([0] * (self.num_spec_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted drafts on average (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
