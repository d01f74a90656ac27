"""Acceptance counters of speculative decoding (cumulative, as vLLM names them)."""

from __future__ import annotations

import re
from typing import Any

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

    def minus(self, then: SpecDecodingStats) -> SpecDecodingStats:
        """The counts of the interval since ``then`` (an earlier copy)."""
        old = then.num_accepted_tokens_per_pos
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - then.num_drafts,
            self.num_draft_tokens - then.num_draft_tokens,
            self.num_accepted_tokens - then.num_accepted_tokens,
            [
                n - (old[i] if i < len(old) else 0)
                for i, n in enumerate(self.num_accepted_tokens_per_pos)
            ],
        )

    @staticmethod
    def total(per_rank: list[SpecDecodingStats | None]) -> SpecDecodingStats | None:
        """The sum over DP ranks (None when no rank speculates)."""
        known = [s for s in per_rank if s is not None]
        if not known:
            return None
        width = max(len(s.num_accepted_tokens_per_pos) for s in known)
        return SpecDecodingStats(
            max(s.num_spec_tokens for s in known),
            sum(s.num_drafts for s in known),
            sum(s.num_draft_tokens for s in known),
            sum(s.num_accepted_tokens for s in known),
            [
                sum(
                    s.num_accepted_tokens_per_pos[i]
                    for s in known
                    if i < len(s.num_accepted_tokens_per_pos)
                )
                for i in range(width)
            ],
        )

    def report(self) -> dict[str, Any]:
        """Fields of a bench JSON result, as ``vllm bench serve`` names them."""
        drafts = max(self.num_drafts, 1)
        return {
            "spec_decode_acceptance_rate": 100 * self.acceptance_rate,
            "spec_decode_acceptance_length": self.mean_acceptance_length,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_draft_tokens": self.num_draft_tokens,
            "spec_decode_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_per_position_acceptance_rates": [
                n / drafts for n in self.num_accepted_tokens_per_pos
            ],
        }


_METRIC = re.compile(
    r"^(?:rackserve|vllm):spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|"
    r"num_accepted_tokens_per_pos)_total\{([^}]*)\}\s+(\S+)$"
)


def from_prometheus(text: str) -> SpecDecodingStats | None:
    """The counters of a /metrics page (rackserve: or vllm: prefix); None without them."""
    stats, found = SpecDecodingStats(), False
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match is None:
            continue
        found = True
        name, labels, value = match.group(1), match.group(2), int(float(match.group(3)))
        if name == "num_accepted_tokens_per_pos":
            position = re.search(r'position="(\d+)"', labels)
            if position is not None:
                per_pos[int(position.group(1))] = value
        else:
            setattr(stats, name, value)
    if not found:
        return None
    stats.num_accepted_tokens_per_pos = [
        per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)
    ]
    stats.num_spec_tokens = len(stats.num_accepted_tokens_per_pos)
    return stats
