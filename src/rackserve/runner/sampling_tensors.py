"""Sampling parameters packed into tensors: per persistent-batch row once, per step by rows.

Shape legend: R rows sampled this step, V vocabulary size, O / P the longest output / prompt
among them, S the most blocked (stop) token ids of any row.

A request's parameters are written into its row of a :class:`SamplingParamTable` when it
joins the batch; each step gathers the rows that sample into one :class:`SamplingTensors`.
``SamplingTensors.from_params`` packs a list of parameters through the same table, so there
is one packing path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rackserve.device import PinnedStaging
from rackserve.request import SamplingParams

__all__ = ["SamplingParamTable", "SamplingTensors", "noise_seed", "pad_token_ids"]


def pad_token_ids(rows: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    """Ragged id lists -> [R, max_len] int64 padded with `pad_id` (at least one column)."""
    width = max((len(row) for row in rows), default=0) or 1
    packed = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        packed[i, : len(row)] = row
    return packed


def noise_seed(seed: int) -> int:
    """Any Python int -> the int64 (two's complement of its low 64 bits) the noise is keyed by."""
    return (seed + 2**63) % 2**64 - 2**63


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
    seeds: torch.Tensor  # [R] int64: the row's seed (SamplingParams.seed or one drawn for it)
    positions: torch.Tensor  # [R] int64: position of the token being sampled (= tokens so far)
    num_logprobs: int | None  # the most any row asks for; None when no row asks
    all_greedy: bool
    all_random: bool

    def select(self, index: Sequence[int], is_greedy: Sequence[bool]) -> SamplingTensors:
        """The rows ``index`` [R'] of every per-row tensor, in that order. ``is_greedy``
        [R']: those rows' greedy flags, known on the host (no device read-back)."""
        device_index = torch.tensor(index, dtype=torch.int64).to(
            self.seeds.device, non_blocking=True
        )
        fields = {}
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            fields[name] = None if value is None else value[device_index]
        return dataclasses.replace(
            self, **fields, all_greedy=all(is_greedy), all_random=not any(is_greedy)
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        seeds: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Pack R requests' parameters (a one-off table of R rows, gathered in order). Row i
        of every tensor belongs to ``params[i]``.

        `output_token_ids[i]` are the tokens generated so far (penalties, min_tokens);
        `prompt_token_ids[i]` are read only when some row has a repetition penalty. The
        sampled token's position is the row's token count. `seeds[i]` is the noise seed of a
        row whose params carry no seed (the runner draws one per request when it joins);
        without `seeds`, every random row must have ``SamplingParams.seed``.
        """
        num_rows = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == num_rows:
            raise ValueError("params, prompt_token_ids and output_token_ids need one entry per row")
        if seeds is not None and len(seeds) != num_rows:
            raise ValueError("seeds needs one entry per row")
        table = SamplingParamTable(num_rows, vocab_size)
        for i, p in enumerate(params):
            if p.seed is not None:
                seed = p.seed
            elif seeds is not None:
                seed = seeds[i]
            elif p.is_greedy:
                seed = 0  # draws nothing
            else:
                raise ValueError(
                    f"row {i} samples at random without a seed: set SamplingParams.seed or "
                    "pass seeds= (one per row)"
                )
            table.set_row(i, p, len(prompt_token_ids[i]), seed)
        token_ids = [
            [*prompt, *output]
            for prompt, output in zip(prompt_token_ids, output_token_ids, strict=True)
        ]
        return table.gather(np.arange(num_rows), token_ids, eos_token_ids, device)


_ROW_FIELDS = (
    "temperature",
    "is_greedy",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "output_token_ids",
    "prompt_token_ids",
    "blocked_token_ids",
    "seeds",
    "positions",
)


class SamplingParamTable:
    """Sampling parameters per persistent-batch row, as numpy columns.

    Written once per request (:meth:`set_row`, greedy rows neutral), read once per step
    (:meth:`gather`: one fancy index per column). Kept as float64 so the "does any row need
    this filter" tests see the values the user gave.
    """

    def __init__(self, max_num_rows: int, vocab_size: int) -> None:
        n = max_num_rows
        self.vocab_size = vocab_size
        self.params: list[SamplingParams | None] = [None] * n
        self.num_prompt_tokens = np.zeros(n, dtype=np.int64)
        self.temperature = np.ones(n)
        self.is_greedy = np.zeros(n, dtype=bool)
        self.top_k = np.full(n, vocab_size, dtype=np.int64)
        self.top_p = np.ones(n)
        self.min_p = np.zeros(n)
        self.presence_penalty = np.zeros(n)
        self.frequency_penalty = np.zeros(n)
        self.repetition_penalty = np.ones(n)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.wants_logprobs = np.zeros(n, dtype=bool)
        self.num_logprobs = np.zeros(n, dtype=np.int64)  # read where wants_logprobs
        self.seed = np.zeros(n, dtype=np.int64)

    def set_row(self, row: int, p: SamplingParams, num_prompt_tokens: int, seed: int) -> None:
        """`seed`: the row's noise seed (``p.seed`` when set, else one drawn for it)."""
        greedy = p.is_greedy
        self.params[row] = p
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.is_greedy[row] = greedy
        self.top_k[row] = p.top_k if p.top_k > 0 and not greedy else self.vocab_size
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.min_tokens[row] = p.min_tokens
        self.wants_logprobs[row] = p.logprobs is not None
        self.num_logprobs[row] = p.logprobs or 0
        self.seed[row] = noise_seed(seed)

    def gather(
        self,
        rows: np.ndarray,
        token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int],
        device: torch.device | str,
        staging: PinnedStaging | None = None,
    ) -> SamplingTensors:
        """SamplingTensors of ``rows`` [R] (in that order). ``token_ids[i]`` (prompt + output
        so far) belongs to ``rows[i]``; it is only sliced when a penalty or min_tokens
        needs the prompt or output part. ``staging``: the runner's, reused step to step
        (None: a new one)."""
        vocab_size = self.vocab_size
        prompt_lens = self.num_prompt_tokens[rows].tolist()

        def prompts() -> list[list[int]]:
            return [ids[:n] for ids, n in zip(token_ids, prompt_lens, strict=True)]

        def outputs() -> list[list[int]]:
            return [ids[n:] for ids, n in zip(token_ids, prompt_lens, strict=True)]

        is_greedy = self.is_greedy[rows]
        top_k = self.top_k[rows]
        top_p = self.top_p[rows]
        min_p = self.min_p[rows]
        presence = self.presence_penalty[rows]
        frequency = self.frequency_penalty[rows]
        repetition = self.repetition_penalty[rows]
        use_presence_or_frequency = bool(presence.any() or frequency.any())
        use_repetition = bool((repetition != 1.0).any())
        blocked = None
        min_tokens = self.min_tokens[rows]
        if min_tokens.any():
            blocked = [[] for _ in range(len(rows))]
            for i in np.flatnonzero(min_tokens).tolist():
                p = self.params[rows[i]]
                assert p is not None
                if len(token_ids[i]) - prompt_lens[i] < p.min_tokens:
                    blocked[i] = ([] if p.ignore_eos else list(eos_token_ids)) + p.stop_token_ids
        wants = self.wants_logprobs[rows]
        positions = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        f32 = np.float32
        columns = {  # what the batch needs, uploaded in one copy
            "temperature": self.temperature[rows].astype(f32),
            "is_greedy": is_greedy,
            "seeds": self.seed[rows],
            "positions": positions,
        }
        if (top_k < vocab_size).any():
            columns["top_k"] = top_k
        if (top_p < 1.0).any():
            columns["top_p"] = top_p.astype(f32)
        if (min_p > 0.0).any():
            columns["min_p"] = min_p.astype(f32)
        if use_presence_or_frequency:
            columns["presence_penalty"] = presence.astype(f32)
            columns["frequency_penalty"] = frequency.astype(f32)
        if use_presence_or_frequency or use_repetition:
            columns["output_token_ids"] = pad_token_ids(outputs(), vocab_size)
        if use_repetition:
            columns["repetition_penalty"] = repetition.astype(f32)
            columns["prompt_token_ids"] = pad_token_ids(prompts(), vocab_size)
        if blocked is not None and any(blocked):
            columns["blocked_token_ids"] = pad_token_ids(blocked, vocab_size)
        staging = staging if staging is not None else PinnedStaging(device)
        tensors = dict(zip(columns, staging.upload(list(columns.values())), strict=True))
        optional = (
            "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "output_token_ids", "prompt_token_ids", "blocked_token_ids",
        )  # fmt: skip
        return SamplingTensors(
            **{name: tensors.get(name) for name in optional},
            temperature=tensors["temperature"],
            is_greedy=tensors["is_greedy"],
            seeds=tensors["seeds"],
            positions=tensors["positions"],
            num_logprobs=int(self.num_logprobs[rows][wants].max()) if wants.any() else None,
            all_greedy=bool(is_greedy.all()),
            all_random=not is_greedy.any(),
        )
