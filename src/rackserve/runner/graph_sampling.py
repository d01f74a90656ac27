"""Sampling inside the decode CUDA graphs: which steps may, the captured variants, and their
static inputs and output.

Shape legend: R requests sampled this step, B the padded batch size of its graph (R <= B),
N the largest graph batch size, V vocabulary size.

A uniform decode step replays its forward graph (``cuda_graph.py``: logits [B, V]). When
its sampling is graph-safe it then replays the sampler graph of the same key, which runs
``sampler.sample`` on those logits with per-row parameters from static buffers and writes
the token ids into a static buffer [N]. The host launches no kernel from the forward's
replay to the copy of the ids to the host: eagerly, ``sample`` launches ~50 small kernels
per step with a random row (the noise hash alone is ~30), and a greedy step one argmax.

Graph-safe (:func:`in_graph_sampling`): no penalties (so no prompt or output token ids),
no min_tokens block, no logprobs, no logit_bias and no structured output (the logits
processors run between the logits and the sampler), no speculative resampling (decode
graphs are not built when speculating). Any of these sends the whole step to the eager
path, exactly as before: the forward graph's logits, the logits processors, ``sample``.

Variants (:class:`SamplerVariant`), one sampler graph each per (batch size, context bucket):

- ``GREEDY``: every row greedy: ``sample``'s argmax.
- ``RANDOM``: per-row temperature and seed, greedy rows mixed in (``is_greedy``, as eager
  ``sample`` does for a mixed batch), no top-k, top-p or min-p.
- ``FILTERED``: the same with top-k, top-p and min-p. A row without a filter holds its
  off value (top_k = V, top_p = 1, min_p = 0), which leaves its logits bit-identical
  (``apply_top_k_top_p``, ``apply_min_p``), so one capture serves every combination of
  filters. Not used for temperature-only steps: the off values still cost a sort of
  [B, V] and ~10 more passes over it, most of what the filters cost.

Why the sampler is a graph of its own, after the forward's, and not captured into it:
sampling depends on the batch size only, and its variants cost very differently (one
argmax against ~50 kernels over [B, V]). Captured into the forward graph, either every
greedy step would run the random path (several ms at B = 256, V = 129280, wasted), or the
whole forward (~1,000 kernels) would be captured once per variant: three times the forward
graphs (up to 15 batch sizes x 5 context buckets = 75 each), their start-up capture time
and their graph memory. A sampler graph has tens of nodes, captures in milliseconds and
reads its forward graph's logits in place (no copy; its intermediates share the graphs'
pool); the price is a second graph launch on a step that samples in the graph.

Equal to eager ``sample``, token for token: every op of ``sample`` is row-wise (the noise
is hashed from each row's seed and position), so rows [0, R) of a padded [B, V] batch
sample what the [R, V] batch does; the off values change nothing; computing the greedy
argmax and ``torch.where`` for an all-random batch picks the random tokens. Padded rows
(R <= row < B) keep the parameters they held (an earlier step's valid ones, or the
initial greedy ones) and sample tokens nobody reads.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rackserve.request import SamplingParams
from rackserve.runner.sampler import sample
from rackserve.runner.sampling_tensors import SamplingTensors

__all__ = ["InGraphSampling", "SamplerVariant", "StaticSampling", "in_graph_sampling"]


class SamplerVariant(enum.Enum):
    GREEDY = "greedy"
    RANDOM = "random"
    FILTERED = "filtered"


# SamplingTensors fields a sampler graph cannot serve: a step that sets any goes eager
_EAGER_ONLY = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "output_token_ids",
    "prompt_token_ids",
    "blocked_token_ids",
    "num_logprobs",
)
_FILTERS = ("top_k", "top_p", "min_p")


@dataclass(frozen=True)
class InGraphSampling:
    """A step's sampling served by a sampler graph: its tensors [R] and the variant."""

    tensors: SamplingTensors
    variant: SamplerVariant


def in_graph_sampling(
    tensors: SamplingTensors | None, params: Sequence[SamplingParams]
) -> InGraphSampling | None:
    """How a decode step samples inside its graphs, or None: eagerly after the forward.
    ``params``: one per sampled row (their logit_bias and structured outputs)."""
    if tensors is None or any(getattr(tensors, name) is not None for name in _EAGER_ONLY):
        return None
    if any(p.logit_bias or p.structured_outputs is not None for p in params):
        return None
    if tensors.all_greedy:
        variant = SamplerVariant.GREEDY
    elif all(getattr(tensors, name) is None for name in _FILTERS):
        variant = SamplerVariant.RANDOM
    else:
        variant = SamplerVariant.FILTERED
    return InGraphSampling(tensors, variant)


class StaticSampling:
    """The sampler graphs' static inputs (per-row parameters, N rows) and output (the
    sampled ids, N rows). One set serves every sampler graph: a step stages its rows, then
    replays one graph."""

    def __init__(self, max_num_rows: int, vocab_size: int, device: torch.device) -> None:
        n = max_num_rows
        self.vocab_size = vocab_size
        self.temperature = torch.ones(n, dtype=torch.float32, device=device)
        self.is_greedy = torch.ones(n, dtype=torch.bool, device=device)
        self.top_k = torch.full((n,), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)  # the output
        self.off = {"top_k": vocab_size, "top_p": 1.0, "min_p": 0.0}  # a filter's off value

    def stage(self, sampling: InGraphSampling) -> None:
        """Copy the step's R rows into the buffers its variant reads (device copies; rows
        past R keep what they held). A filter no row uses gets its off value."""
        tensors, variant = sampling.tensors, sampling.variant
        if variant is SamplerVariant.GREEDY:
            return  # the argmax reads no parameter
        num_rows = tensors.seeds.shape[0]
        for name in ("temperature", "is_greedy", "seeds", "positions"):
            getattr(self, name)[:num_rows].copy_(getattr(tensors, name))
        if variant is SamplerVariant.FILTERED:
            for name in _FILTERS:
                value = getattr(tensors, name)
                rows = getattr(self, name)[:num_rows]
                if value is not None:
                    rows.copy_(value)
                else:
                    rows.fill_(self.off[name])

    def tensors(self, num_rows: int, variant: SamplerVariant) -> SamplingTensors:
        """The first ``num_rows`` static rows as ``sample``'s input for ``variant``."""
        filtered = variant is SamplerVariant.FILTERED
        return SamplingTensors(
            temperature=self.temperature[:num_rows],
            is_greedy=self.is_greedy[:num_rows],
            top_k=self.top_k[:num_rows] if filtered else None,
            top_p=self.top_p[:num_rows] if filtered else None,
            min_p=self.min_p[:num_rows] if filtered else None,
            presence_penalty=None,
            frequency_penalty=None,
            repetition_penalty=None,
            output_token_ids=None,
            prompt_token_ids=None,
            blocked_token_ids=None,
            seeds=self.seeds[:num_rows],
            positions=self.positions[:num_rows],
            num_logprobs=None,
            all_greedy=variant is SamplerVariant.GREEDY,
            all_random=False,  # per row: is_greedy picks argmax or the random token
        )

    def sample(self, logits: torch.Tensor, variant: SamplerVariant) -> torch.Tensor:
        """The sampler graph's region: ``sample`` over logits [B, V] and the static rows,
        the ids into the static output. Returns that output's first B rows."""
        num_rows = logits.shape[0]
        out = sample(logits, self.tensors(num_rows, variant))
        self.token_ids[:num_rows].copy_(out.token_ids)
        return self.token_ids[:num_rows]
