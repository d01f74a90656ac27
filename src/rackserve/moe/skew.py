"""Skewed (Zipf-like) expert popularity, so that load imbalance is real on test models.

Shape legend: L MoE layers, E experts, T tokens, k experts per token, V vocabulary.

Random-weight test models route almost uniformly, which hides what EPLB is for. Real
models have hot experts: expert popularity roughly follows a power law, popularity of the
i-th most popular expert ~ 1 / i^s. Each layer gets its own random ranking of the experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rackserve import ops


def zipf_popularity(
    num_layers: int, num_experts: int, exponent: float, generator: torch.Generator
) -> torch.Tensor:
    """Per-layer expert popularity [L, E] (rows sum to 1): a Zipf law with ``exponent``
    (0 = uniform), over a random ranking of the experts per layer."""
    if exponent < 0:
        raise ValueError(f"zipf exponent must be >= 0, got {exponent}")
    law = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    law = law / law.sum()
    ranking = torch.stack(
        [torch.randperm(num_experts, generator=generator) for _ in range(num_layers)]
    )
    return law[ranking.argsort(dim=1)]


def sample_topk(
    popularity: torch.Tensor, num_tokens: int, top_k: int, generator: torch.Generator
) -> torch.Tensor:
    """Route ``num_tokens`` tokens of one layer: k distinct experts each, drawn without
    replacement from popularity [E]. Returns topk_ids [T, k] int64 (uniform popularity gives
    uniform random top-k, the reference routing)."""
    if top_k > popularity.shape[0]:
        raise ValueError(f"top_k {top_k} exceeds the {popularity.shape[0]} experts")
    # Gumbel top-k draws k distinct items with the same law as sequential sampling
    # without replacement, in one vectorised call.
    uniform = torch.rand(num_tokens, popularity.shape[0], generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-300)))
    return torch.topk(popularity.log() + gumbel, top_k, dim=1).indices


def synthetic_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    num_tokens: int,
    exponent: float,
    seed: int = 0,
) -> torch.Tensor:
    """A routing trace [L, T, k] of logical expert ids with Zipf popularity per layer."""
    generator = torch.Generator().manual_seed(seed)
    popularity = zipf_popularity(num_layers, num_experts, exponent, generator)
    return torch.stack([sample_topk(p, num_tokens, top_k, generator) for p in popularity])


# Top-k of log(p) + Gumbel noise (std pi / sqrt 6) samples by p; a router's score noise has
# another spread, so the tilt is rescaled to it.
_GUMBEL_SCALE = math.sqrt(6) / math.pi


def _score_spread(router: nn.Module, generator: torch.Generator) -> float:
    """Mean per-expert std of the router's scores over unit-RMS random hidden states (the
    MoE input is RMS-normed)."""
    weight = router.weight.detach().float().cpu()
    x = torch.randn(256, weight.shape[1], generator=generator)
    scores = ops.router_scores(F.linear(x, weight), router.scoring_func)
    return float(scores.std(0).mean())


@torch.no_grad()
def apply_skewed_routing(model: nn.Module, exponent: float, seed: int = 0) -> int:
    """Make a (test) model's routers prefer experts by a Zipf law, in place, at load time.

    Hash routers (a ``tid2eid`` [V, k] table) get every token id's k experts drawn from the
    law, so popularity follows it exactly under uniform token ids. Learned routers (a
    ``bias`` [E] correction, selection only) get ``log(popularity)`` added, scaled to the
    spread of their scores, so the top-k leans towards the hot experts about as a Zipf draw
    would while the scores still vary per token (approximate: it depends on the hidden
    states). Returns the
    number of routers changed; modules are found by those attributes, in module order.
    """
    routers = [
        m
        for m in model.modules()
        if hasattr(m, "top_k")
        and hasattr(m, "weight")
        and (hasattr(m, "tid2eid") or hasattr(m, "bias"))
    ]
    generator = torch.Generator().manual_seed(seed)
    for router in routers:
        table = getattr(router, "tid2eid", None)
        if table is not None:
            num_experts = router.weight.shape[0]
            popularity = zipf_popularity(1, num_experts, exponent, generator)[0]
            ids = sample_topk(popularity, table.shape[0], table.shape[1], generator)
            table.copy_(ids.to(table.dtype))
        else:
            popularity = zipf_popularity(1, router.bias.shape[0], exponent, generator)[0]
            tilt = popularity.log() * _score_spread(router, generator) * _GUMBEL_SCALE
            router.bias.add_(tilt.to(router.bias.dtype))
    return len(routers)
