"""The contracts between the engine's parts.

    API process --EngineCoreRequest--> engine core
    scheduler --SchedulerOutput--> runner --RunnerOutput--> scheduler
    engine core --EngineCoreOutputs--> API process (new token ids, finish, stats)

Messages that cross processes are msgspec Structs (compact msgpack, array-like).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from rackserve.request import SamplingParams
from rackserve.spec_decode.stats import SpecDecodingStats

# ---- scheduler -> runner ----------------------------------------------------------------


@dataclass
class NewRequestData:
    """A request the runner has not seen (new, or resumed after preemption: it recomputes
    ``token_ids`` from ``num_computed_tokens``, which a prefix hit may have advanced)."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per cache group, the whole block table
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The running requests the runner knows, as parallel lists (one object per step, as in
    vLLM v1: a per-request object plus its per-group lists cost ~1 us per request per step).
    Request i is ``req_ids[i]``; ``new_block_ids[i]`` holds, per cache group, the block ids
    appended to its block table since the last step, or None when no group got a block
    (most decode steps)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req id -> tokens to compute this step
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)


# ---- runner -> scheduler ----------------------------------------------------------------


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled position: ``token_ids[0]`` is the sampled token, then the top
    n; ``rank`` is the sampled token's rank (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class RunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] for a prefill chunk that ends before the prompt
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    expert_counts: torch.Tensor | None = None  # [num_layers, E] routed tokens this step
    num_accepted_draft_tokens: dict[str, int] = field(default_factory=dict)
    # speculative decoding: the drafts each request proposes for its next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    forward_time_s: float = 0.0
    # device time of the drafts proposed on the device behind the step collected before
    # this one (this step's still runs when it is collected); 0 when none were
    propose_time_s: float = 0.0


# ---- across processes -------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class Logprob(msgspec.Struct, array_like=True):
    token_ids: list[int]
    logprobs: list[float]
    rank: int


# gc=False: one per request per step and never part of a reference cycle; untracked, they
# do not trigger or lengthen the cyclic GC's collections.
class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None  # sent once, with the first token
    finish_reason: str | None = None  # FinishReason value once finished
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # time.monotonic() (host-wide) when first scheduled; sent with the first token only,
    # so the frontend's queue time is exact even when the prefill took several steps
    first_scheduled_time: float | None = None
    # why the engine failed this request alone (finish_reason "abort"; the API answers 400),
    # e.g. its structured-output grammar did not compile in time
    error: str | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of the scarcest cache group in use
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    num_preemptions: int = 0  # cumulative
    # Expert parallelism: per MoE layer, mean / max rank load over the EPLB window, and the
    # same batches routed uniformly at random (the ceiling); absent without EP.
    expert_balancedness: list[float] | None = None
    expert_balancedness_uniform: list[float] | None = None
    # Host KV pool (kv/offload; zero without one): prompt tokens served from the pool tier
    # (also counted in prefix_cache_hits), bytes moved each way (cumulative), its fill.
    prefix_cache_pool_hits: int = 0
    kv_offload_bytes: int = 0
    kv_load_bytes: int = 0
    kv_pool_usage: float = 0.0
    # P/D decode side: requests whose prompt KV has not landed yet; KV bytes received
    num_waiting_for_remote_kv: int = 0
    kv_bytes_received: int = 0  # cumulative
    spec_decoding: SpecDecodingStats | None = None  # cumulative; absent without speculation


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
