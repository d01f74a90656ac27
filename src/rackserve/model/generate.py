"""A minimal single-request generation loop over contiguous (unshared) cache blocks.

It is the model's own test harness and the simplest way to run a checkpoint; serving
goes through the engine (paged cache manager, scheduler, batching).
"""

from __future__ import annotations

import torch

from rackserve.kv.spec import cache_groups_for
from rackserve.model.batch import (
    KVCacheTensors,
    StepMetadata,
    closing_tokens,
    compressed_ratios,
)
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM


class ContiguousCache:
    """Every request owns a private run of blocks long enough for ``max_len`` tokens; a
    sliding group's run is a ring of ``ring_blocks(max_step_tokens)`` blocks (slot j in
    block j % R, as the runner's tables), so it does not grow with ``max_len``."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        num_reqs: int,
        max_len: int,
        max_step_tokens: int | None = None,
    ) -> None:
        """``max_step_tokens``: the most new tokens of one request in one :meth:`batch`
        (None: ``max_len``, any chunking)."""
        self.groups = cache_groups_for(model.cfg, num_mtp_layers=len(model.mtp))
        device = next(model.parameters()).device
        dtype = model.head.weight.dtype
        step = max_len if max_step_tokens is None else max_step_tokens
        per_req = {}
        for g in self.groups:
            linear = -(-max_len // g.block_tokens)
            per_req[g.name] = min(linear, g.ring_blocks(step)) if g.is_sliding else linear
        # block 0 is the null block of the paged pools; keep the same convention here
        self.tensors = KVCacheTensors(
            self.groups, {n: 1 + num_reqs * b for n, b in per_req.items()}, dtype, device
        )
        self.block_tables = {
            n: (1 + torch.arange(num_reqs * b, device=device).view(num_reqs, b))
            for n, b in per_req.items()
        }

    def batch(self, num_computed: list[int], num_new: list[int], reqs: list[int]) -> StepMetadata:
        """Metadata for requests ``reqs`` (rows of the block tables) with their new tokens."""
        device = next(iter(self.block_tables.values())).device
        positions = torch.cat(
            [torch.arange(c, c + n) for c, n in zip(num_computed, num_new, strict=True)]
        )
        token_req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(num_new))
        rows = torch.tensor(reqs, device=device)
        closing = closing_tokens(positions.numpy(), compressed_ratios(self.groups))
        return StepMetadata.build(
            self.groups,
            positions.to(device),
            token_req.to(device),
            {name: table[rows] for name, table in self.block_tables.items()},
            max(c + n for c, n in zip(num_computed, num_new, strict=True)),
            {r: torch.from_numpy(tokens).to(device) for r, tokens in closing.items()},
        )


@torch.inference_mode()
def generate_tokens(
    model: DeepseekV4ForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy (temperature 0) or sampled generation for one prompt."""
    device = next(model.parameters()).device
    # the prompt is one step, then one token a step: sliding groups need a ring that wide
    cache = ContiguousCache(
        model, 1, len(prompt_ids) + max_new_tokens, max_step_tokens=max(len(prompt_ids), 1)
    )
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    out: list[int] = []
    tokens, computed = list(prompt_ids), 0
    while len(out) < max_new_tokens:
        ids = torch.tensor(tokens[computed:], device=device)
        batch = cache.batch([computed], [len(ids)], [0])
        hidden, _ = model(ids, batch, cache.tensors)
        logits = model.compute_logits(hidden[-1:])[0]
        computed = len(tokens)
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        out.append(token)
        tokens.append(token)
        if token in stop_ids:
            break
    return out
