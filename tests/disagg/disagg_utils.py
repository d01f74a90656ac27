"""Two engine cores in one process (prefill + decode) and a driver of the P/D handshake."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from rackserve.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.parallel.groups import free_port_block
from rackserve.request import KVTransferParams, SamplingParams


def make_core(
    model_dir: Path,
    kv_transfer: DisaggConfig | None = None,
    max_num_seqs: int = 48,
    max_num_batched_tokens: int = 512,
    kv_cache_memory: int | None = 32 << 20,
    long_prefill_token_threshold: int = 0,
    speculative: SpecConfig | None = None,
) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=kv_cache_memory),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        device="cpu",
        kv_transfer=kv_transfer,
        speculative=speculative,
    )
    return EngineCore(config, log_stats=False)


def producer_config(transport: str = "tcp", **kwargs) -> DisaggConfig:
    return DisaggConfig(
        kv_role="kv_producer", kv_connector=transport, kv_port=free_port_block(4), **kwargs
    )


def consumer_config(transport: str = "tcp", **kwargs) -> DisaggConfig:
    return DisaggConfig(kv_role="kv_consumer", kv_connector=transport, **kwargs)


def drain(core: EngineCore, outputs: dict[str, list[int]], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)


def prefill(
    core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """The router's first step: every prompt through the prefill engine (max_tokens 1).
    Returns the token each sampled (t1)."""
    for req_id, ids in prompts.items():
        kv = KVTransferParams(do_remote_decode=True, transfer_id=req_id)
        p = replace(params, kv_transfer_params=kv)
        core.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
    firsts: dict[str, list[int]] = {}
    drain(core, firsts)
    return firsts


def decode(
    core: EngineCore,
    producer: EngineCore,
    prompts: dict[str, list[int]],
    params: SamplingParams,
    outputs: dict[str, list[int]] | None = None,
    firsts: dict[str, list[int]] | None = None,
) -> dict[str, list[int]]:
    """The router's second step: the decode engine pulls each prompt's KV and generates;
    ``firsts`` (from :func:`prefill`) go along as the answer's first tokens."""
    host, port = producer.kv_connector.server.address
    outputs = {} if outputs is None else outputs
    for req_id, ids in prompts.items():
        kv = KVTransferParams(
            do_remote_prefill=True, transfer_id=req_id, remote_host=host, remote_port=port,
            first_token_ids=tuple((firsts or {}).get(req_id, ())),
        )  # fmt: skip
        p = replace(params, kv_transfer_params=kv)
        core.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
    drain(core, outputs)
    return outputs
