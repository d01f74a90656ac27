"""Token sampling over a batch of requests: pure functions on CPU or GPU tensors.

Shape legend: R requests (one logits row each), V vocabulary size, O / P the longest output /
prompt in the batch, S the most blocked (stop) token ids of any row, N = num_logprobs + 1.

Order of operations on each row (vLLM's):

    raw logits ──> logprobs (returned to the user: the raw model distribution)
        │
        ├─ min_tokens: EOS / stop_token_ids -> -inf until the row has min_tokens outputs
        ├─ penalties: repetition (prompt + output), then frequency and presence (output)
        ├─ greedy rows: argmax here
        └─ temperature -> min_p -> top_k -> top_p -> exponential-race sample

Logprobs are computed from the raw logits, before penalties and temperature: this is vLLM
v1's default (`logprobs_mode="raw_logprobs"`), and it keeps logprobs comparable across
requests with different sampling settings.

Sampling uses the exponential race: token = argmax(probs / q) with q ~ Exp(1) drawn per
vocabulary entry, which picks token i with probability probs[i]. Seeded rows draw their q
from their own `torch.Generator`, so their tokens depend only on their own logits, their own
parameters and their generator's state, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rackserve.request import SamplingParams

__all__ = [
    "LogprobsTensors",
    "SamplerOutput",
    "SamplingTensors",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_logprobs",
    "make_generator",
    "pad_token_ids",
    "sample",
]


def pad_token_ids(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """Ragged id lists -> [R, max_len] int64 padded with `pad_id` (at least one column)."""
    width = max((len(row) for row in rows), default=0) or 1
    packed = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    return torch.tensor(packed, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class SamplingTensors:
    """The batch's sampling parameters packed once per step.

    Token-id tensors are padded with V (one past the vocabulary): scattering into a [R, V + 1]
    buffer and dropping the last column discards the padding without a mask.
    Optional tensors are None when no row in the batch needs them, so common batches skip
    the work entirely.
    """

    temperature: torch.Tensor  # [R] float32; 1.0 on greedy rows so nothing divides by 0
    is_greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor | None  # [R] int64; V where off
    top_p: torch.Tensor | None  # [R] float32; 1.0 where off
    min_p: torch.Tensor | None  # [R] float32; 0.0 where off
    presence_penalty: torch.Tensor | None  # [R] float32
    frequency_penalty: torch.Tensor | None  # [R] float32
    repetition_penalty: torch.Tensor | None  # [R] float32
    output_token_ids: torch.Tensor | None  # [R, O] int64, padded with V
    prompt_token_ids: torch.Tensor | None  # [R, P] int64, padded with V
    blocked_token_ids: torch.Tensor | None  # [R, S] int64, padded with V (min_tokens)
    num_logprobs: int | None  # the most any row asks for; None when no row asks
    all_greedy: bool
    all_random: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Pack R requests' parameters. Row i of every tensor belongs to ``params[i]``.

        `output_token_ids[i]` are the tokens generated so far (penalties, min_tokens);
        `prompt_token_ids[i]` are read only when some row has a repetition penalty.
        """
        num_rows = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == num_rows:
            raise ValueError("params, prompt_token_ids and output_token_ids need one entry per row")

        def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.is_greedy for p in params]
        # Greedy rows get neutral values: filters are no-ops there, and leaving them off keeps
        # the "any row needs this filter" checks below honest.
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        for p in params:
            temperature.append(1.0 if p.is_greedy else p.temperature)
            top_k.append(p.top_k if p.top_k > 0 and not p.is_greedy else vocab_size)
            top_p.append(1.0 if p.is_greedy else p.top_p)
            min_p.append(0.0 if p.is_greedy else p.min_p)
        use_presence_or_frequency = any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params
        )
        use_repetition = any(p.repetition_penalty != 1.0 for p in params)

        blocked: list[list[int]] = []
        for p, outputs in zip(params, output_token_ids, strict=True):
            if len(outputs) < p.min_tokens:
                # ignore_eos: EOS never stops the request, so there is nothing to hold back.
                stop_ids = [] if p.ignore_eos else list(eos_token_ids)
                blocked.append(stop_ids + p.stop_token_ids)
            else:
                blocked.append([])

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=column(temperature, torch.float32),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=column(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=column(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=column(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            presence_penalty=column([p.presence_penalty for p in params], torch.float32)
            if use_presence_or_frequency
            else None,
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32)
            if use_presence_or_frequency
            else None,
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32)
            if use_repetition
            else None,
            output_token_ids=pad_token_ids(output_token_ids, vocab_size, device)
            if use_presence_or_frequency or use_repetition
            else None,
            prompt_token_ids=pad_token_ids(prompt_token_ids, vocab_size, device)
            if use_repetition
            else None,
            blocked_token_ids=pad_token_ids(blocked, vocab_size, device) if any(blocked) else None,
            num_logprobs=max(requested) if requested else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )


@dataclass(frozen=True)
class LogprobsTensors:
    """Column 0 is the sampled token; columns 1..N-1 are the top tokens, best first."""

    token_ids: torch.Tensor  # [R, N] int64
    logprobs: torch.Tensor  # [R, N] float32
    ranks: torch.Tensor  # [R] int64, 1-based rank of the sampled token


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request; keep it for the request's lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, L] ids padded with V -> [R, V] bool: which tokens occur in each row."""
    mask = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device
    )
    mask.scatter_(1, token_ids, True)
    return mask[:, :vocab_size]


def apply_min_tokens(logits: torch.Tensor, blocked_token_ids: torch.Tensor) -> torch.Tensor:
    """logits: [R, V]; blocked_token_ids: [R, S] padded with V. Blocked tokens -> -inf."""
    return logits.masked_fill(_token_mask(blocked_token_ids, logits.shape[1]), float("-inf"))


def apply_penalties(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Repetition penalty on prompt + output tokens, then frequency and presence on output.

    logits: [R, V] -> [R, V]. Repetition divides positive logits and multiplies negative ones
    (so it always lowers the token's probability for penalty > 1).
    """
    num_rows, vocab_size = logits.shape
    if tensors.repetition_penalty is not None:
        assert tensors.prompt_token_ids is not None and tensors.output_token_ids is not None
        seen = _token_mask(tensors.prompt_token_ids, vocab_size) | _token_mask(
            tensors.output_token_ids, vocab_size
        )
        penalty = tensors.repetition_penalty.unsqueeze(1)  # [R, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if tensors.frequency_penalty is not None:
        assert tensors.output_token_ids is not None and tensors.presence_penalty is not None
        output_ids = tensors.output_token_ids
        counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
        counts = counts[:, :vocab_size]  # [R, V]
        logits = logits - tensors.frequency_penalty.unsqueeze(1) * counts
        logits = logits - tensors.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability.

    logits: [R, V] (temperature already applied); min_p: [R].
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k best tokens, then the smallest set holding top_p of the mass.

    logits: [R, V]; top_k: [R] int64 (V = off); top_p: [R] (1.0 = off). Ties with the k-th
    logit are kept. One ascending sort serves both filters.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)  # [R, V] each
    if top_k is not None:
        kth_index = (vocab_size - top_k).clamp(0, vocab_size - 1).unsqueeze(1)  # [R, 1]
        kth_value = sorted_logits.gather(1, kth_index)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        # The ascending cumulative mass of the tail; a token is dropped when the tail up to
        # and including it still holds no more than 1 - top_p.
        tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = tail_mass <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the best token always survives, whatever the rounding
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def compute_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """logprobs: [R, V] (log_softmax); token_ids: [R] -> the sampled token + top num_logprobs."""
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [R, n] each
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled, top_values], dim=1),
        ranks=ranks,
    )


def _exponential_noise(
    probs: torch.Tensor,
    generators: Mapping[int, torch.Generator],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """q ~ Exp(1) of the shape of probs [R, V]; seeded rows draw from their own generator."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, row_generator in generators.items():
        noise[row].exponential_(generator=row_generator)
    # exponential_ may return exactly 0 in float32; that would make p / q = inf (or nan).
    return noise.clamp_min_(torch.finfo(probs.dtype).tiny)


def sample(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    generators: Mapping[int, torch.Generator] | None = None,
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Pick one token per row.

    logits: [R, V] float32, not modified. `generators` maps a row index to that seeded
    request's generator; other random rows share `generator` (None: torch's default RNG).
    Greedy rows draw nothing, so a seeded request that is greedy keeps its generator state.
    """
    generators = generators or {}
    raw_logprobs = logits.log_softmax(dim=-1) if tensors.num_logprobs is not None else None

    if tensors.blocked_token_ids is not None:
        logits = apply_min_tokens(logits, tensors.blocked_token_ids)
    logits = apply_penalties(logits, tensors)

    greedy_ids = logits.argmax(dim=-1) if not tensors.all_random else None
    if tensors.all_greedy:
        assert greedy_ids is not None
        token_ids = greedy_ids
    else:
        logits = logits / tensors.temperature.unsqueeze(1)
        if tensors.min_p is not None:
            logits = apply_min_p(logits, tensors.min_p)
        logits = apply_top_k_top_p(logits, tensors.top_k, tensors.top_p)
        probs = logits.softmax(dim=-1)  # [R, V]
        random_generators = {
            row: g for row, g in generators.items() if not bool(tensors.is_greedy[row])
        }
        noise = _exponential_noise(probs, random_generators, generator)
        token_ids = (probs / noise).argmax(dim=-1)
        if greedy_ids is not None:
            token_ids = torch.where(tensors.is_greedy, greedy_ids, token_ids)

    logprobs = None
    if raw_logprobs is not None:
        assert tensors.num_logprobs is not None
        logprobs = compute_logprobs(raw_logprobs, token_ids, tensors.num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
