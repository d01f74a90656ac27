"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob given
the tokens before it, its rank and the top tokens at its position, accumulated over a
prompt's prefill chunks from the step's hidden states."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rackserve.engine.outputs import TokenLogprobs
from rackserve.runner.input_batch import RunnerRequest


def _prefilling_with_logprobs(r: RunnerRequest, computed: int) -> bool:
    """Whether request ``r``, ``computed`` tokens in, computes prompt logprobs this step: it
    asks for them and is still in its prompt (a request resumed after preemption, with
    outputs, got them already)."""
    return (
        r.sampling_params.prompt_logprobs is not None
        and computed < r.num_prompt_tokens
        and len(r.token_ids) <= r.num_prompt_tokens
    )


def needs_every_row(reqs: list[RunnerRequest], computed: list[int]) -> bool:
    """Whether a step needs every row's hidden state (a request's prompt logprobs), not only
    the sampled rows'."""
    return any(_prefilling_with_logprobs(r, c) for r, c in zip(reqs, computed, strict=True))


def accumulate_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    reqs: list[RunnerRequest],
    starts: list[int],
    computed: list[int],
    hidden: torch.Tensor,
) -> dict[str, list[TokenLogprobs | None]]:
    """Accumulate prompt logprobs chunk by chunk (``r.prompt_logprobs``); return them
    per request whose prompt ended in this step (``compute_logits``: the model's head).

    ::

        prompt     t0    t1  ...  t[c]  ...  t[c+n-1]  ...  t[P-1]
        entry      None  lp(t1 | t0) ... entry j scores t[j] from position j-1

    The scheduler computes such a prompt from position 0 (no prefix hit), so every entry
    is computed once, in order. A request resumed after preemption has outputs and got
    its prompt logprobs already. One device-to-host copy per tensor per chunk.
    """
    done: dict[str, list[TokenLogprobs | None]] = {}
    for k, r in enumerate(reqs):
        num, c = r.sampling_params.prompt_logprobs, computed[k]
        if not _prefilling_with_logprobs(r, c):
            continue
        if c == 0:
            r.prompt_logprobs = [None]  # the first prompt token has no logprob
        end = min(starts[k + 1] - starts[k], r.num_prompt_tokens - 1 - c)
        if end > 0:
            logits = compute_logits(hidden[starts[k] : starts[k] + end])
            lp = logits.float().log_softmax(dim=-1)  # [end, V]
            targets = torch.tensor(r.token_ids[c + 1 : c + 1 + end], device=lp.device)
            chosen = lp.gather(1, targets[:, None])  # [end, 1]
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            top = lp.topk(num, dim=-1)  # [end, num] each (num may be 0)
            ids = torch.cat([targets[:, None], top.indices], dim=1).tolist()
            values = torch.cat([chosen, top.values], dim=1).tolist()
            r.prompt_logprobs.extend(map(TokenLogprobs, ids, values, ranks))
        if c + starts[k + 1] - starts[k] >= r.num_prompt_tokens:
            done[r.req_id] = r.prompt_logprobs
    return done
