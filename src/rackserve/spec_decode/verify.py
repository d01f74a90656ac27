"""Exact verification of draft tokens: pure functions on host lists and small tensors.

Shape legend: R requests, K draft tokens per request, V vocabulary.

The target scores 1 + K positions of a request in one forward::

    positions   L        L+1      ...  L+K
    input       x_L      d_1      ...  d_K          (x_L: the last accepted token)
    target      t_0      t_1      ...  t_K          (t_j: the target's token after d_1..d_j)

Drafts are accepted while they equal the target's token at their position; the first
mismatch is replaced by the target's token, and when all K match, t_K is the bonus token.
So a step emits ``t_0 .. t_a`` (a = number of accepted drafts, 0..K).

Greedy rows: t_j is the argmax, the output is the greedy output token for token. Random rows:
the engine's drafters propose greedily, so the draft distribution q is one-hot on d and the
standard rejection rule (:func:`rejection_sample`) reduces to "accept d with probability
p(d), else sample from p without d". Sampling t_j ~ p with the request's own noise (the
sampler's hash of seed, position and token) and accepting iff t_j == d realises exactly that:
P(accept) = p(d), and on rejection t_j ~ p(. | t_j != d) = normalised (p - q)+. It also makes
the output the very tokens the non-speculative engine samples with the same seed, with every
sampling parameter (penalties, top-k/p, min-p, logprobs) applied by the one sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verification_prefixes(token_ids: list[int], num_drafts: int) -> list[list[int]]:
    """The token history each verified position samples after: ``token_ids`` ends with the
    ``num_drafts`` drafts; position j (0..K) sees the history plus drafts d_1..d_j, so the
    sampler's penalties, min_tokens and noise position are those of a plain decode step."""
    base = len(token_ids) - num_drafts
    return [token_ids[: base + j] for j in range(num_drafts + 1)]


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


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative rejection sampling (Leviathan et al.; Chen et al.).

    target_probs: [R, K+1, V] p at each verified position (after every sampling transform);
    draft_ids: [R, K]; draft_probs: [R, K, V] q, or None for greedy drafts (one-hot q);
    uniform: [R, K] in (0, 1); noise: [R, K+1, V] Exp(1) for the exponential race.
    Draft j is accepted with probability min(1, p(d_j) / q(d_j)); at the first rejection the
    token is drawn from normalised (p - q)+, and when all K are accepted a bonus token from
    p at position K. Returns (tokens [R, K+1], num_accepted [R]): row r emits
    ``tokens[r, : num_accepted[r] + 1]``; later columns are unused.
    """
    num_reqs, k, vocab = draft_ids.shape[0], draft_ids.shape[1], target_probs.shape[-1]
    if target_probs.shape != (num_reqs, k + 1, vocab) or noise.shape != target_probs.shape:
        raise ValueError("target_probs and noise must be [R, K+1, V] for draft_ids [R, K]")
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_ids, vocab).to(target_probs.dtype)
    p = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2)  # [R, K]
    q = draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2)  # [R, K]
    accepted = uniform * q < p  # u < p / q, without dividing by a zero q
    # leading run of acceptances: cumprod stays 1 until the first rejection
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]
    residual = (target_probs[:, :k] - draft_probs).clamp_(min=0)  # [R, K, V]
    # a rejection with (p - q)+ all zero cannot happen (it needs p == q, which accepts)
    residual = torch.cat([residual, target_probs[:, k:]], dim=1)  # the bonus position: p
    recovered = (residual / noise).argmax(dim=2)  # [R, K+1]
    tokens = torch.cat([draft_ids, draft_ids[:, :1]], dim=1).clone()
    rows = torch.arange(num_reqs, device=draft_ids.device)
    tokens[rows, num_accepted] = recovered[rows, num_accepted]
    return tokens, num_accepted
