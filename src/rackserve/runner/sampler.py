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
vocabulary entry, which picks token i with probability probs[i]. The noise is not drawn from
a generator: q[r, v] is a counter-based integer hash of (seed of row r, position of the token
being sampled, v), computed with torch integer ops on the logits' device. A row's token is
therefore a pure function of (seed, position, logits, params): the same alone or in a batch
of 64, on CPU or GPU, and after a preemption recomputes the request. There is no per-row
generator and no host sync, and every shape is fixed given R and V (CUDA-graph friendly).
Other draws of the same row (speculative decoding's acceptance test and residual draw,
spec_decode/verify.py) hash a ``stream`` number into the row's key: independent noise, as
pure a function of (seed, position) as the token's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rackserve.runner.sampling_tensors import SamplingTensors

__all__ = [
    "LogprobsTensors",
    "SamplerOutput",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_logprobs",
    "sample",
    "sampling_noise",
    "sampling_probs",
    "sampling_uniform",
]

_MASK32 = 0xFFFFFFFF


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

    logits: [R, V] (temperature already applied); min_p: [R]. A row at min_p = 0 comes back
    bit-identical (no probability is below 0).
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k best tokens, then the smallest set holding top_p of the mass.

    logits: [R, V]; top_k: [R] int64 (V = off); top_p: [R] (1.0 = off). Ties with the k-th
    logit are kept. One ascending sort serves both filters. A row at the off value comes
    back bit-identical, so a batch where one row filters leaves the others as they were
    alone, and a decode graph can pass the off values for rows without a filter
    (runner/graph_sampling.py).
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
        # and including it still holds no more than 1 - top_p. At top_p = 1 that bound would
        # be 0 and drop the tokens whose probability underflows to 0: -1 keeps them.
        tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        bound = torch.where(top_p < 1.0, 1.0 - top_p, -1.0)  # [R]
        drop = tail_mass <= bound.unsqueeze(1)
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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding [0, 2^32).

    Integer ops only, so CPU and GPU give the same bits. No product leaves int64's range: the
    first multiplier is < 2^31, and the second (>= 2^31) is used as its negative twin
    c - 2^32, equal modulo 2^32, so each product lies in (-2^63, 2^63) and the mask takes its
    low 32 bits (two's complement).
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * (0x846CA68B - 2**32)) & _MASK32
    return x ^ (x >> 16)


def _row_key(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """seeds, positions: [R] int64 -> [R] 32-bit keys; stream 0 is the token's own draw."""
    seed_low = seeds & _MASK32
    seed_high = (seeds >> 32) & _MASK32  # arithmetic shift: the mask keeps the right bits
    key = _mix32(seed_low ^ 0x9E3779B9)
    key = _mix32(key ^ seed_high)
    key = _mix32(key ^ (positions & _MASK32))
    if stream:
        key = _mix32(key ^ (stream & _MASK32))
    return key


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 u = (k + 1/2) / 2^23 from the top 23 bits, exact in float32
    and never 0 or 1 (24 bits would round the largest u to 1.0)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def sampling_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = 0
) -> torch.Tensor:
    """q ~ Exp(1) per (row, vocabulary entry), a pure function of (seed, position, id).

    seeds, positions: [R] int64 -> [R, V] float32. Each row gets a 32-bit key from its seed's
    two halves and the position (and ``stream``, when not 0: an independent draw of the same
    row); entry v hashes key ^ (v * golden ratio), which is distinct for every v of a row.
    q = -log(u) > 0 for u uniform in (0, 1) (``_uniform``: q = 0 would win any race).
    """
    key = _row_key(seeds, positions, stream)  # [R]
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    vocab_term = (vocab_ids * 0x9E3779B1) & _MASK32  # [V]; < 2^17 * 2^32: no overflow
    bits = _mix32(key.unsqueeze(1) ^ vocab_term.unsqueeze(0))  # [R, V]
    return _uniform(bits).log_().neg_()


def sampling_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """u ~ U(0, 1) per row, a pure function of (seed, position, stream): [R] -> [R] float32.
    ``stream`` must not be 0 (that stream is the token's own draw)."""
    if stream == 0:
        raise ValueError("stream 0 is the sampled token's own noise; use another stream")
    return _uniform(_mix32(_row_key(seeds, positions, stream)))


def sampling_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """The distribution a random row samples from: temperature -> min_p -> top-k/top-p ->
    softmax. logits: [R, V] (penalties and min_tokens already applied, if wanted) -> [R, V]
    float32. Greedy rows come out at temperature 1 (their probabilities are not used)."""
    logits = logits / tensors.temperature.unsqueeze(1)
    if tensors.min_p is not None:
        logits = apply_min_p(logits, tensors.min_p)
    logits = apply_top_k_top_p(logits, tensors.top_k, tensors.top_p)
    return logits.softmax(dim=-1).float()


# (token_ids [R], probs [R, V]) -> token_ids [R]: spec_decode/verify.py's rejection step
Resample = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sample(
    logits: torch.Tensor, tensors: SamplingTensors, resample: Resample | None = None
) -> SamplerOutput:
    """Pick one token per row.

    logits: [R, V] float32, not modified. Random rows race on `sampling_noise` keyed by the
    row's seed and position; greedy rows take the argmax after penalties. ``resample`` (a
    batch with random rows only) may replace tokens given the probabilities they were drawn
    from, before logprobs are taken (speculative verification). No host sync.
    """
    raw_logprobs = logits.log_softmax(dim=-1) if tensors.num_logprobs is not None else None

    if tensors.blocked_token_ids is not None:
        logits = apply_min_tokens(logits, tensors.blocked_token_ids)
    logits = apply_penalties(logits, tensors)

    greedy_ids = logits.argmax(dim=-1) if not tensors.all_random else None
    if tensors.all_greedy:
        assert greedy_ids is not None
        token_ids = greedy_ids
    else:
        probs = sampling_probs(logits, tensors)  # [R, V]
        noise = sampling_noise(tensors.seeds, tensors.positions, probs.shape[1])
        token_ids = (probs / noise).argmax(dim=-1)
        if greedy_ids is not None:
            token_ids = torch.where(tensors.is_greedy, greedy_ids, token_ids)
        if resample is not None:
            token_ids = resample(token_ids, probs)

    logprobs = None
    if raw_logprobs is not None:
        assert tensors.num_logprobs is not None
        logprobs = compute_logprobs(raw_logprobs, token_ids, tensors.num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
