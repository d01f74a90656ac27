"""Per-request edits of the logits before sampling: OpenAI's ``logit_bias`` and the token
bitmask of structured output. Pure functions on tensors (S sampled rows, V vocabulary).

The runner calls ``apply_logits_processors`` once per step (the one hook), between the
logits and the sampler; a step whose requests use neither feature costs one attribute
test per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rackserve.request import SamplingParams


def apply_logit_bias(
    logits: torch.Tensor, biases: Sequence[dict[int, float] | None]
) -> torch.Tensor:
    """Add ``biases[s][token]`` to ``logits[s, token]`` in place; returns ``logits``.

    logits: [S, V]; ``biases``: one sparse map per row (None: no bias). All entries go to
    the device as one index/value upload (no per-request copies). Token ids at or above V
    are ignored (the API checks them against the tokenizer)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab_size = logits.shape[-1]
    for row, bias in enumerate(biases):
        if not bias:
            continue
        for token_id, value in bias.items():
            if token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
                values.append(value)
    if not rows:
        return logits
    device = logits.device
    index = torch.tensor([rows, cols], dtype=torch.int64).to(device, non_blocking=True)
    add = torch.tensor(values, dtype=logits.dtype).to(device, non_blocking=True)
    logits.index_put_((index[0], index[1]), add, accumulate=True)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits[s, v]`` to -inf where bit ``v`` of row ``s`` is 0; returns ``logits``.

    logits: [S, V]; bitmask: [S, ceil(V / 32)] int32, bit ``v % 32`` of word ``v // 32``
    (xgrammar's and llguidance's layout). Rows that are all ones are unconstrained. Runs
    on the logits' device with tensor ops only: no host sync."""
    num_rows, vocab_size = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    # [S, W, 32] -> [S, W * 32] -> [S, V]
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool()
    allowed = allowed.reshape(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The runner's hook: logit_bias of the sampled requests (logits [S, V], one
    SamplingParams per row), then the structured-output bitmask [S, ceil(V / 32)] when a
    row is constrained (runner/structured_output.py; all ones elsewhere). The mask comes
    last so no bias can re-allow a token the grammar forbids."""
    if any(p.logit_bias for p in params):
        apply_logit_bias(logits, [p.logit_bias for p in params])
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    return logits
