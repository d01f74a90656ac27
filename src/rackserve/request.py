"""The request that flows through the engine (`Request`, its `RequestStatus`) and what it
asks for (`SamplingParams`)."""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by a near-zero temperature
# overflows to inf and gives the same argmax anyway (vLLM uses the same threshold).
GREEDY_TEMPERATURE_EPS = 1e-5
# Most top logprobs a request may ask for, per token (vLLM's default `max_logprobs`).
MAX_NUM_LOGPROBS = 20
# Integer fields travel as int64 (the runner's tables, torch generators, msgspec): a value
# outside this range is refused up front rather than overflowing inside the engine loop.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a seeded ``n > 1`` request: ``seed + index``,
    wrapped into int64 so a seed near the top of the range never overflows."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


# OpenAI's range for a logit_bias value.
MAX_ABS_LOGIT_BIAS = 100.0


# --------------------------------------------------------------------------------------
# StructuredOutputsParams, SamplingParams
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must match, shaped like vLLM's: exactly one of ``json`` (a JSON
    schema, as a dict or its text), ``regex``, ``choice`` (one of these strings),
    ``grammar`` (EBNF with ``root ::= ...``, or Lark) and ``json_object`` (any JSON object).

    ``disable_any_whitespace``: JSON without free whitespace (else runs of at most a few
    whitespace characters are allowed between JSON tokens). The runner compiles the grammar
    (runner/structured_output.py); :meth:`key` is its cache key.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # Text is the cache key. Keys keep their order: it is the order of the output's
            # properties.
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar and "
                f"json_object; got {', '.join(kinds) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs choice must be a non-empty list of non-empty strings, "
                f"got {self.choice!r}"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str, bool]:
        """(kind, text, disable_any_whitespace): what the compiled grammar depends on."""
        kind = self.kind
        value = getattr(self, kind)
        text = json.dumps(value) if kind == "choice" else "" if kind == "json_object" else value
        return kind, text, self.disable_any_whitespace


# one carried token's logprobs: (token ids, logprobs, rank), the sampled token first, as
# engine.outputs.Logprob holds them
CarriedLogprob = tuple[tuple[int, ...], tuple[float, ...], int]


@dataclass(frozen=True)
class KVTransferParams:
    """The P/D handshake (vLLM's ``kv_transfer_params``). To a prefill engine:
    ``do_remote_decode`` (run the prompt, keep its KV for ``num_consumers`` pulls). To a
    decode engine: ``do_remote_prefill`` and where the KV waits (``remote_host:remote_port``,
    ``transfer_id``). The router copies the prefill response's params into the decode
    request; ``num_cached_tokens`` is the prefill side's prefix hit, reported by decode.

    ``first_token_ids`` (with ``first_logprobs`` when logprobs were asked: the token ids,
    logprobs and rank of ``Logprob``) is the token the prefill engine sampled after the
    prompt: the decode engine emits it on arrival, before the KV lands, so the first token's
    latency does not wait for the transfer or a decode step."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str = ""
    remote_host: str | None = None
    remote_port: int | None = None
    remote_engine_id: str | None = None
    num_consumers: int = 1
    num_cached_tokens: int = 0
    first_token_ids: tuple[int, ...] = ()
    first_logprobs: tuple[CarriedLogprob, ...] | None = None

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude")
        if (self.do_remote_decode or self.do_remote_prefill) and not self.transfer_id:
            raise ValueError("kv_transfer_params: transfer_id is required")
        if self.do_remote_prefill and (not self.remote_host or self.remote_port is None):
            raise ValueError("kv_transfer_params: do_remote_prefill needs remote_host/remote_port")
        if not 1 <= self.num_consumers <= 1024:
            raise ValueError("kv_transfer_params: num_consumers must be in [1, 1024]")
        if not 0 <= self.num_cached_tokens <= INT64_MAX:
            raise ValueError("kv_transfer_params: num_cached_tokens must be >= 0")
        if self.remote_port is not None and not 0 < self.remote_port <= 65535:
            raise ValueError("kv_transfer_params: remote_port must be in [1, 65535]")
        if len(self.first_token_ids) > 1 or any(t < 0 for t in self.first_token_ids):
            raise ValueError("kv_transfer_params.first_token_ids must be one token id >= 0")
        logprobs = self.first_logprobs
        if logprobs is not None and (
            len(logprobs) != len(self.first_token_ids)
            or any(
                ids[:1] != (t,)
                for (ids, _, _), t in zip(logprobs, self.first_token_ids, strict=True)
            )
        ):
            raise ValueError("kv_transfer_params.first_logprobs must describe first_token_ids")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferParams:
        """A request's JSON object; unknown keys are ignored (vLLM adds its own)."""
        if not isinstance(raw, dict):
            raise ValueError("kv_transfer_params must be an object")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        types = {"transfer_id": str, "remote_host": str, "remote_engine_id": str}
        for name, value in known.items():
            if name in ("first_token_ids", "first_logprobs"):
                continue
            want = types.get(name, bool if name.startswith("do_") else int)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"kv_transfer_params.{name} must be a {want.__name__}")
        if "first_token_ids" in known:
            known["first_token_ids"] = _int_tuple(known["first_token_ids"], "first_token_ids")
        if "first_logprobs" in known:
            known["first_logprobs"] = tuple(map(_logprob_entry, _items(known["first_logprobs"])))
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``from_dict`` reads (fields at their defaults left out)."""
        out = {
            k: getattr(self, k)
            for k, f in self.__dataclass_fields__.items()
            if getattr(self, k) != f.default
        }
        if "first_token_ids" in out:
            out["first_token_ids"] = list(self.first_token_ids)
        if self.first_logprobs is not None:
            out["first_logprobs"] = [
                {"token_ids": list(ids), "logprobs": list(values), "rank": rank}
                for ids, values, rank in self.first_logprobs
            ]
        return out


def _items(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError("kv_transfer_params.first_logprobs must be a list")
    return value


def _int_tuple(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(
        not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= INT64_MAX for v in value
    ):
        raise ValueError(f"kv_transfer_params.{name} must be a list of token ids")
    return tuple(value)


def _logprob_entry(raw: Any) -> CarriedLogprob:
    """One ``first_logprobs`` entry: {"token_ids": [...], "logprobs": [...], "rank": r}."""
    message = "kv_transfer_params.first_logprobs entries are {token_ids, logprobs, rank}"
    if not isinstance(raw, dict):
        raise ValueError(message)
    ids = _int_tuple(raw.get("token_ids"), "first_logprobs.token_ids")
    values, rank = raw.get("logprobs"), raw.get("rank")
    if (
        not ids
        or not isinstance(values, list)
        or len(values) != len(ids)
        or not all(_is_logprob(v) for v in values)
        or not isinstance(rank, int)
        or isinstance(rank, bool)
        or not 1 <= rank <= INT64_MAX  # the engine's outputs hold it as a 64-bit int
    ):
        raise ValueError(message)
    return ids, tuple(float(v) for v in values), rank


def _is_logprob(value: Any) -> bool:
    """A finite number (an int too large for a float would fail float())."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**53


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters, shaped like vLLM's.

    `temperature == 0` means greedy. `top_k` of 0 or -1 disables top-k (both are accepted, as
    in vLLM; -1 is normalised to 0). `stop` may be given as one string. `max_tokens` is a
    concrete number: the API layer resolves an omitted value to the remaining context.
    Penalties follow vLLM/OpenAI: presence and frequency count generated tokens only;
    repetition multiplies the logits of every token seen in prompt or output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> value added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # a grammar the output must match (structured output: JSON schema, regex, choice, ...)
    structured_outputs: StructuredOutputsParams | None = None
    # P/D disaggregation handshake (disagg/): None for an aggregated request
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        # Normalise the accepted aliases once, so the rest of the engine sees one spelling.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        else:
            object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed"):
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or a positive count, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}); "
                "raise max_tokens or lower min_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_NUM_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_NUM_LOGPROBS}], got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        for token_id, value in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}")
            if not (math.isfinite(value) and abs(value) <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}], got {value}"
                )

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless the token-id fields fit a vocabulary of ``vocab_size``."""
        if self.top_k > vocab_size:
            raise ValueError(
                f"top_k must be at most the vocabulary size {vocab_size} (0 or -1 = off), "
                f"got {self.top_k}"
            )
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys must be in [0, {vocab_size}), got {bad[0]}")
        kv = self.kv_transfer_params
        if kv is not None:
            carried = [*kv.first_token_ids, *(t for e in kv.first_logprobs or () for t in e[0])]
            bad = [t for t in carried if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"kv_transfer_params.first_token_ids must be in [0, {vocab_size}), got {bad[0]}"
                )

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature is (numerically) zero."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# --------------------------------------------------------------------------------------
# Request
# --------------------------------------------------------------------------------------


class FinishReason(enum.StrEnum):
    """The OpenAI ``finish_reason`` values a request can end with."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.IntEnum):
    """Where a request is. Every value from FINISHED_STOPPED on is final."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # P/D decode side: pushed KV not yet arrived
    WAITING_FOR_FSM = enum.auto()  # structured output: its grammar is still compiling
    WAITING_FOR_POOL_KV = enum.auto()  # prefix blocks loading from the host KV pool
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False, slots=True)  # slots: read several times per request per step
class Request:
    """One sequence in the engine. Phase-free: the scheduler only compares
    ``num_computed_tokens`` with ``num_tokens``; a prefix-cache hit simply starts
    ``num_computed_tokens`` above zero."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the priority policy, as in vLLM
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify
    # async scheduling: tokens sampled by launched steps, not yet read back (vLLM's name)
    num_output_placeholders: int = 0
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first admitted
    # P/D prefill side: 1. The decode side recomputes the last prompt token, so a step's
    # commit stops one token short and that token's window stays in the table to be sent.
    kv_commit_lag: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
