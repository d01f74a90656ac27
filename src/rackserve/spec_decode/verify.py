"""Exact verification of draft tokens: pure functions on host lists and small tensors, and
the draft distributions kept from one step to the next.

Shape legend: R logits rows of the step, W requests drafting, K draft tokens per request,
D rows that verify a sampled draft, V vocabulary.

The target scores 1 + K positions of a request in one forward::

    positions   L        L+1      ...  L+K
    input       x_L      d_1      ...  d_K          (x_L: the last accepted token)
    target      t_0      t_1      ...  t_K          (t_j: the row's token, after d_1..d_j)

Drafts are accepted while they equal the row's token; the first mismatch is replaced by the
row's token, and when all K match, t_K is the bonus token. So a step emits ``t_0 .. t_a``
(a = number of accepted drafts, 0..K): :func:`accept_drafts`.

What the row's token t_j is decides the rule:

- greedy requests: drafts are the draft's argmax, t_j the target's argmax; the output is
  the greedy output token for token.
- random requests: draft d_j is sampled from q_j, the draft's logits after the request's
  temperature, min-p, top-k and top-p (:func:`sample_drafts`; no penalties: any q is
  exact, and this one is cheap). The sampler computes p_j (every transform, penalties and
  logits processors included, on the prefix of a plain decode step:
  :func:`verification_prefixes`), then :func:`resample_rejected` applies the standard rule
  (Leviathan et al.; Chen et al.): t_j = d_j when u < p_j(d_j) / q_j(d_j), else a draw from
  normalised (p_j - q_j)+, which never is d_j; the bonus row keeps the sampler's draw from
  p_K. Every draw is counter-based noise of (seed, position, stream): the same seed gives
  the same tokens run to run and alone or in any batch. The draft uses the position's own
  stream (the one the plain engine samples with), so a draft whose q equals p is accepted
  and gives exactly the plain engine's tokens; acceptance and residual use streams 1 and 2.
- random requests whose q is not known (drafts kept past a step they were not verified in):
  t_j is the sampler's draw from p_j and d_j is accepted iff t_j == d_j. t_j ~ p_j whatever
  d_j is, so this is exact too (it is the plain engine's output), only less accepting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rackserve.runner.sampler import (
    Resample,
    sampling_noise,
    sampling_probs,
    sampling_uniform,
)
from rackserve.runner.sampling_tensors import SamplingTensors

ACCEPT_STREAM = 1  # u of the acceptance test
RESIDUAL_STREAM = 2  # the draw from (p - q)+


class TokenPrefix(Sequence[int]):
    """``token_ids[:length]`` without the copy: the sampler reads a verified position's
    length (its noise position) every step and slices the ids only for penalties and
    min_tokens. (The copies took ~0.5 ms a step under cProfile at 32 requests of 1024
    tokens, K = 3, H100 host, 2026-12-07.)"""

    __slots__ = ("_ids", "_length")

    def __init__(self, token_ids: list[int], length: int) -> None:
        self._ids, self._length = token_ids, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step > 0:  # (a negative step's stop of -1 would mean the list's end)
                return self._ids[start:stop:step]
            return self._ids[: self._length][index]
        if not -self._length <= index < self._length:
            raise IndexError(index)
        return self._ids[index % self._length]


def verification_prefixes(token_ids: list[int], num_drafts: int) -> list[TokenPrefix]:
    """The token history each verified position samples after: ``token_ids`` ends with the
    ``num_drafts`` drafts; position j (0..K) sees the history plus drafts d_1..d_j, so the
    sampler's penalties, min_tokens and noise position are those of a plain decode step."""
    base = len(token_ids) - num_drafts
    return [TokenPrefix(token_ids, base + j) for j in range(num_drafts + 1)]


def accept_drafts(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """The tokens a verify step emits: target_ids [K+1], draft_ids [K] -> t_0 .. t_a."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(
            f"need one target token per draft plus one, got {len(target_ids)} for "
            f"{len(draft_ids)} drafts"
        )
    a = 0
    while a < len(draft_ids) and draft_ids[a] == target_ids[a]:
        a += 1
    return list(target_ids[: a + 1])


def accepted_counts(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """:func:`accept_drafts` on the device, for R requests at once: draft_ids [R, K],
    target_ids [R, K + 1] -> a [R], the number of drafts accepted (t_0 .. t_a emitted)."""
    matches = draft_ids == target_ids[:, : draft_ids.shape[1]]
    return matches.cumprod(dim=1).sum(dim=1)


def sample_drafts(
    logits: torch.Tensor, tensors: SamplingTensors, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row: logits [W, V] of the draft, ``tensors`` [W] the requests'
    sampling rows, positions [W] the position each draft will take.

    Greedy rows take the argmax; random rows race q = :func:`sampling_probs` (temperature,
    min-p, top-k, top-p) on the position's own noise. Returns (tokens [W], q [W, V] float32,
    or None when every row is greedy; greedy rows' q is not meaningful)."""
    greedy = logits.argmax(dim=-1)
    if tensors.all_greedy:
        return greedy, None
    probs = sampling_probs(logits, tensors)
    tokens = (probs / sampling_noise(tensors.seeds, positions, probs.shape[1])).argmax(dim=-1)
    return torch.where(tensors.is_greedy, greedy, tokens), probs


def resample_rejected(
    token_ids: torch.Tensor,
    probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
) -> torch.Tensor:
    """The standard rejection rule on the D rows that verify a sampled draft.

    token_ids [R] (the sampler's draws), probs [R, V] (p), seeds and positions [R] (the
    rows' noise keys); rows [D] which rows, draft_ids [D] their drafts, draft_probs [D, V]
    the q each was drawn from. Row ``rows[i]`` gets its draft when u < p(d) / q(d), else a
    draw from normalised (p - q)+; other rows keep their token. Returns token_ids [R] (a new
    tensor)."""
    p = probs[rows]  # [D, V]
    q = draft_probs.to(p.dtype)
    p_draft = p.gather(1, draft_ids[:, None]).squeeze(1)  # [D]
    q_draft = q.gather(1, draft_ids[:, None]).squeeze(1)  # [D]
    row_seeds, row_positions = seeds[rows], positions[rows]
    accepted = sampling_uniform(row_seeds, row_positions, ACCEPT_STREAM) * q_draft < p_draft
    residual = (p - q).clamp_(min=0)  # [D, V]
    noise = sampling_noise(row_seeds, row_positions, p.shape[1], RESIDUAL_STREAM)
    recovered = (residual / noise).argmax(dim=1)  # [D]
    # (p - q)+ is all zero only where p == q up to rounding, which rejects with probability
    # ~1e-7: keep the sampler's draw from p there
    recovered = torch.where(residual.sum(dim=1) > 0, recovered, token_ids[rows])
    out = token_ids.clone()
    out[rows] = torch.where(accepted, draft_ids, recovered)
    return out


class DraftDistributions:
    """The q of each random request's drafts, from the step that proposed them to the step
    that verifies them (the next one; anything older is dropped)."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[list[int], torch.Tensor]] = {}  # drafts, q [K, V]

    def keep(
        self,
        req_ids: Sequence[str],
        drafts: Sequence[list[int]],
        probs: torch.Tensor | None,
        is_greedy: Sequence[bool],
    ) -> None:
        """This step's proposals: req_ids, drafts [W] and probs [W, K, V] (None: all
        greedy). Replaces what the last step kept."""
        self._pending = {}
        if probs is None:
            return
        for w, (req_id, ids, greedy) in enumerate(zip(req_ids, drafts, is_greedy, strict=True)):
            if not greedy and ids:
                self._pending[req_id] = (ids, probs[w])

    def resampler(
        self,
        req_ids: Sequence[str],
        drafts: Sequence[Sequence[int]],
        first_rows: Sequence[int],
        sampling: SamplingTensors,
    ) -> Resample | None:
        """The rejection step of a verify step, or None (no row verifies a sampled draft).

        Per sampled request: req_id, the drafts it verifies (a prefix of those proposed,
        the scheduler may cut them) and its first logits row; ``sampling`` [R]."""
        rows: list[int] = []
        draft_ids: list[int] = []
        qs: list[torch.Tensor] = []
        for req_id, ids, first in zip(req_ids, drafts, first_rows, strict=True):
            kept = self._pending.get(req_id)
            if not ids or kept is None or list(ids) != kept[0][: len(ids)]:
                continue  # greedy, nothing to verify, or q unknown: t == d (exact)
            rows.extend(range(first, first + len(ids)))
            draft_ids.extend(ids)
            qs.append(kept[1][: len(ids)])
        self._pending = {}
        if not rows:
            return None
        device = sampling.seeds.device
        # non-blocking: the copy queues behind the forward instead of waiting for it
        rows_d, ids_d = torch.tensor([rows, draft_ids]).to(device, non_blocking=True)
        q = torch.cat(qs)  # [D, V]

        def resample(token_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            return resample_rejected(
                token_ids, probs, sampling.seeds, sampling.positions, rows_d, ids_d, q
            )

        return resample
