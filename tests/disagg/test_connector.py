"""P/D in one process: a prefill core and a decode core over each transport, against one
aggregated core at temperature 0; prefix hits on the decode side; the admission cap;
failures with both policies; no leaked blocks."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from rackserve.config import ConfigError, DisaggConfig, SpecConfig
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import KVTransferParams, SamplingParams

from disagg_utils import consumer_config, decode, drain, make_core, prefill, producer_config

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(10, 4000, (70,), generator=g).tolist()
    out = {}
    for i in range(8):
        n = int(torch.randint(1, 150, (1,), generator=g))
        tail = torch.randint(10, 4000, (n,), generator=g).tolist()
        out[f"r{i}"] = (shared + tail) if i % 2 else tail
    out["one"] = [42]  # nothing to transfer: decode computes it
    return out


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    core = make_core(tiny)
    outputs: dict[str, list[int]] = {}
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, PARAMS, time.time()))
    drain(core, outputs)
    return outputs


def idle(core) -> bool:
    return core.scheduler.kv.usage == 0 and not core.has_unfinished_requests()


@pytest.mark.parametrize("transport", ["tcp", "shm", "nccl"])
def test_pd_equals_aggregated(tiny, prompts, expected, transport):
    producer = make_core(tiny, producer_config(transport))
    consumer = make_core(tiny, consumer_config(transport))
    try:
        prefill(producer, prompts, PARAMS)
        assert idle(producer)  # blocks freed at once; the copies wait in the store
        assert len(producer.kv_connector.store) == len(prompts) - 1  # not "one"
        outputs = decode(consumer, producer, prompts, PARAMS)
        assert outputs == expected
        assert consumer.kv_connector.num_loads == len(prompts) - 1
        assert consumer.kv_connector.num_failures == 0
        assert consumer.kv_connector.num_bytes_received > 0
        assert len(producer.kv_connector.store) == 0  # each pulled once, then dropped
        assert idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_first_token_is_emitted_before_the_kv_lands(tiny, prompts, expected, transport):
    """The prefill engine's t1 rides in the decode request's kv_transfer_params: the decode
    side emits it at its first step, while the (delayed) pull is still in flight; the KV of
    the whole prompt lands, so t1's step computes t1 alone (a decode step); the rest equals
    an aggregated engine's."""
    extra = {"inject_fault": "delay:1"}
    producer = make_core(tiny, producer_config(transport, kv_connector_extra_config=extra))
    consumer = make_core(tiny, consumer_config(transport))
    subset = {k: prompts[k] for k in ("r0", "r1", "one")}
    try:
        firsts = prefill(producer, subset, PARAMS)
        assert firsts == {k: expected[k][:1] for k in subset}  # the whole prompt ran there
        host, port = producer.kv_connector.server.address
        for req_id, ids in subset.items():
            kv = KVTransferParams(
                do_remote_prefill=True, transfer_id=req_id, remote_host=host,
                remote_port=port, first_token_ids=tuple(firsts[req_id]),
            )  # fmt: skip
            p = replace(PARAMS, kv_transfer_params=kv)
            consumer.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
        outputs: dict[str, list[int]] = {}
        for out in consumer.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert {k: v[:1] for k, v in outputs.items() if k != "one"} == {
            k: firsts[k] for k in ("r0", "r1")
        }
        assert consumer.kv_connector.num_loads == 0  # their KV has not landed yet
        scheduled: dict[str, list[int]] = {}  # tokens per step of r0 and r1 once they run
        deadline = time.monotonic() + 60
        while consumer.has_unfinished_requests():
            assert time.monotonic() < deadline
            for out in consumer.step().outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            for req_id, n in consumer.last_step.num_scheduled_tokens.items():
                scheduled.setdefault(req_id, []).append(n)
        assert outputs == {k: expected[k] for k in subset}
        assert scheduled["r0"] == scheduled["r1"] == [1] * (len(expected["r0"]) - 1)
        assert consumer.kv_connector.num_loads == 2 and idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("carried", [True, False])
def test_pd_with_mtp_equals_aggregated(tiny, prompts, carried):
    """Speculating with the MTP layer (its rows travel in the window group): the decode side
    computes the last prompt token again (with t1 when carried), and the output equals an
    aggregated engine's that speculates alike."""
    spec = SpecConfig("mtp", 2)
    subset = {k: prompts[k] for k in ("r0", "r1", "r3", "one")}
    aggregated = make_core(tiny, speculative=spec)
    producer = make_core(tiny, producer_config(), speculative=spec)
    consumer = make_core(tiny, consumer_config(), speculative=spec)
    try:
        for req_id, ids in subset.items():
            aggregated.add_request(EngineCoreRequest(req_id, ids, PARAMS, time.time()))
        want: dict[str, list[int]] = {}
        drain(aggregated, want)
        firsts = prefill(producer, subset, PARAMS)
        got = decode(consumer, producer, subset, PARAMS, firsts=firsts if carried else None)
        assert got == want
        assert consumer.scheduler.spec_stats.num_draft_tokens > 0  # it did speculate
        assert consumer.kv_connector.num_loads == len(subset) - 1 and idle(consumer)
    finally:
        for core in (aggregated, producer, consumer):
            core.shutdown()


def test_first_token_that_ends_the_request(tiny, prompts, expected):
    """max_tokens 1, or t1 a stop token: the request ends on arrival and nothing is pulled
    (the prefill side's copy goes with its lease)."""
    producer = make_core(tiny, producer_config(lease_s=0.5))
    consumer = make_core(tiny, consumer_config())
    subset = {k: prompts[k] for k in ("r0", "r1")}
    try:
        firsts = prefill(producer, subset, PARAMS)
        one = replace(PARAMS, max_tokens=1)
        assert decode(consumer, producer, {"r0": subset["r0"]}, one, firsts=firsts) == {
            "r0": expected["r0"][:1]
        }
        stop = replace(PARAMS, ignore_eos=False, stop_token_ids=firsts["r1"])
        consumer.add_request(
            EngineCoreRequest("r1", subset["r1"], replace(stop, kv_transfer_params=KVTransferParams(
                do_remote_prefill=True, transfer_id="r1", remote_host="127.0.0.1",
                remote_port=1, first_token_ids=tuple(firsts["r1"]),
            )), time.time())
        )  # fmt: skip
        finished = [o for o in consumer.step().outputs if o.request_id == "r1"]
        assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in finished] == [
            (firsts["r1"], "stop", firsts["r1"][0])
        ]
        assert consumer.kv_connector.num_loads == 0 and idle(consumer)
        time.sleep(0.7)
        producer.kv_connector.store.expire()
        assert len(producer.kv_connector.store) == 0 and idle(producer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_prompt_logprobs_ignore_a_carried_first_token(tiny, prompts, expected):
    """Prompt logprobs are computed here (every prompt position), and they go out with the
    first token this engine samples: a carried t1 is not taken, so none goes missing."""
    producer = make_core(tiny, producer_config())
    consumer = make_core(tiny, consumer_config())
    try:
        firsts = prefill(producer, {"r0": prompts["r0"]}, PARAMS)
        params = replace(PARAMS, prompt_logprobs=1, kv_transfer_params=KVTransferParams(
            do_remote_prefill=True, transfer_id="r0", remote_host="127.0.0.1", remote_port=1,
            first_token_ids=tuple(firsts["r0"])))  # fmt: skip
        consumer.add_request(EngineCoreRequest("r0", prompts["r0"], params, time.time()))
        tokens, with_prompt_logprobs = [], 0
        deadline = time.monotonic() + 60
        while consumer.has_unfinished_requests():
            assert time.monotonic() < deadline
            for out in consumer.step().outputs:
                tokens += out.new_token_ids
                with_prompt_logprobs += out.prompt_logprobs is not None
        assert tokens == expected["r0"] and with_prompt_logprobs == 1
        assert consumer.kv_connector.num_loads == 0 and idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_min_tokens_keeps_eos_masked_for_the_first_token(tiny, prompts):
    """EOS made the argmax (logit_bias) and min_tokens 2: the prefill side's t1 is not EOS,
    as an aggregated engine's is not; the P/D output equals it, EOS third."""
    aggregated = make_core(tiny)
    eos = aggregated.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=2, logit_bias={eos: 50.0})
    producer = make_core(tiny, producer_config())
    consumer = make_core(tiny, consumer_config())
    subset = {k: prompts[k] for k in ("r0", "r2")}
    try:
        for req_id, ids in subset.items():
            aggregated.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
        want: dict[str, list[int]] = {}
        drain(aggregated, want)
        assert all(len(v) == 3 and v[-1] == eos for v in want.values())
        firsts = prefill(producer, subset, params)
        assert firsts == {k: v[:1] for k, v in want.items()}
        assert decode(consumer, producer, subset, params, firsts=firsts) == want
    finally:
        for core in (aggregated, producer, consumer):
            core.shutdown()


def test_decode_pulls_only_blocks_it_lacks(tiny, prompts):
    """Agent turns (next prompt = prompt + output + new text): the decode side's prefix cache
    holds the previous turn (its finish checkpoint), so it asks the prefill side only for
    the rest; outputs equal an aggregated engine's over the same turns."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    turn1 = {k: v for k, v in prompts.items() if k in ("r0", "r1", "r2", "r3")}
    aggregated = make_core(tiny)
    producer = make_core(tiny, producer_config())
    consumer = make_core(tiny, consumer_config())
    try:
        for req_id, ids in turn1.items():
            aggregated.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
        want1: dict[str, list[int]] = {}
        drain(aggregated, want1)
        prefill(producer, turn1, params)
        got1 = decode(consumer, producer, turn1, params)
        assert got1 == want1
        full = [g for g, spec in enumerate(consumer.scheduler.kv.specs) if not spec.is_sliding]
        first = [consumer.kv_connector.num_blocks_received[g] for g in full]
        turn2 = {f"{k}-2": ids + want1[k] + [7, 8, 9, 10, 11] for k, ids in turn1.items()}
        for req_id, ids in turn2.items():
            aggregated.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
        want2: dict[str, list[int]] = {}
        drain(aggregated, want2)
        prefill(producer, turn2, params)
        got2 = decode(consumer, producer, turn2, params)
        assert got2 == want2
        second = [
            consumer.kv_connector.num_blocks_received[g] - n
            for g, n in zip(full, first, strict=True)
        ]
        # turn 2's prompts are longer, yet far fewer history blocks travel (the window and
        # compressor state pages always do: they hold rows a hit does not)
        assert sum(second) < sum(first) / 2, (first, second)
        assert idle(consumer)
    finally:
        for core in (aggregated, producer, consumer):
            core.shutdown()


def test_admission_cap_from_step_records(tiny, prompts):
    producer = make_core(tiny, producer_config())
    consumer = make_core(tiny, consumer_config(max_kv_loads_per_step=2))
    try:
        many = {f"{k}-{j}": v for j in range(3) for k, v in prompts.items() if k != "one"}
        prefill(producer, many, PARAMS)
        decode(consumer, producer, many, PARAMS)
        records = consumer.kv_connector.records
        assert sum(r.num_loaded for r in records) == len(many)
        assert max(r.num_loaded for r in records) <= 2
        assert max(r.num_admitted for r in records) <= 2
        assert idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize(
    "fault,transport",
    [
        ("corrupt_chunk", "tcp"),
        ("drop_connection", "tcp"),
        ("delay:3", "tcp"),
        ("corrupt_chunk", "nccl"),  # streamed over the pair (gloo here): its checksum
        ("drop_connection", "nccl"),
    ],
)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failures(tiny, prompts, expected, fault, transport, policy):
    extra = {"inject_fault": fault}
    producer = make_core(tiny, producer_config(transport, kv_connector_extra_config=extra))
    lease = 1.0 if fault.startswith("delay") else 30.0
    consumer = make_core(
        tiny, consumer_config(transport, kv_load_failure_policy=policy, lease_s=lease)
    )
    subset = {k: prompts[k] for k in ("r0", "r1", "r2")}
    try:
        prefill(producer, subset, PARAMS)
        start = time.monotonic()
        outputs = decode(consumer, producer, subset, PARAMS)
        assert time.monotonic() - start < 20
        if policy == "recompute":
            assert outputs == {k: expected[k] for k in subset}
        else:
            assert all(not v for v in outputs.values())
            errors = dict(consumer.take_request_errors())
            assert set(errors) == set(subset)
            assert all("KV transfer" in m for m in errors.values())
        assert consumer.kv_connector.num_failures == len(subset)
        assert idle(consumer) and idle(producer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_lease_expires_on_the_prefill_side(tiny, prompts):
    producer = make_core(tiny, producer_config(lease_s=0.3))
    try:
        prefill(producer, {"r0": prompts["r0"]}, PARAMS)
        assert len(producer.kv_connector.store) == 1
        time.sleep(0.6)
        producer.kv_connector.store.expire()
        assert len(producer.kv_connector.store) == 0
        assert idle(producer)
    finally:
        producer.shutdown()


def test_abort_while_waiting_for_kv_frees_blocks(tiny, prompts):
    producer = make_core(
        tiny, producer_config(kv_connector_extra_config={"inject_fault": "delay:1"})
    )
    consumer = make_core(tiny, consumer_config())
    try:
        prefill(producer, {"r3": prompts["r3"]}, PARAMS)
        host, port = producer.kv_connector.server.address
        from dataclasses import replace

        from rackserve.engine.outputs import EngineCoreRequest
        from rackserve.request import KVTransferParams

        kv = KVTransferParams(
            do_remote_prefill=True, transfer_id="r3", remote_host=host, remote_port=port
        )
        consumer.add_request(
            EngineCoreRequest(
                "r3", prompts["r3"], replace(PARAMS, kv_transfer_params=kv), time.time()
            )
        )
        consumer.step()
        assert consumer.scheduler.kv.usage > 0  # blocks reserved, the pull is in flight
        consumer.abort_requests(["r3"])
        drain(consumer, {})
        time.sleep(1.5)
        consumer.step()  # the late landing is dropped
        assert idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_config_errors():
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        DisaggConfig.from_json('{"kv_role": "prefill"}')
    with pytest.raises(ConfigError, match="unknown keys"):
        DisaggConfig.from_json('{"kv_role": "kv_producer", "kv_prot": 1}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        DisaggConfig.from_json("{kv_role")
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        DisaggConfig.from_json('{"kv_role": "kv_consumer", "kv_load_failure_policy": "x"}')
    with pytest.raises(ConfigError, match="kv_connector must be one of"):
        DisaggConfig.from_json('{"kv_role": "kv_consumer", "kv_connector": "rdma"}')
    with pytest.raises(ConfigError, match="needs kv_port"):
        DisaggConfig.from_json('{"kv_role": "kv_producer"}')
    with pytest.raises(ConfigError, match="needs --kv-transfer-config"):
        DisaggConfig.from_json(None, max_kv_loads_per_step=2)
    with pytest.raises(ConfigError, match="kv_port must be"):
        DisaggConfig.from_json('{"kv_role": "kv_consumer", "kv_port": 70000}')
    config = DisaggConfig.from_json(
        '{"kv_role": "kv_both", "kv_port": 5, "kv_rank": 0}', max_kv_loads_per_step=8
    )
    assert config.is_producer and config.is_consumer and config.max_kv_loads_per_step == 8


def test_serve_flags_build_the_config(tiny):
    from rackserve.cli import build_parser
    from rackserve.server.options import build_engine_config, resolve_options

    args = build_parser().parse_args(
        ["serve", str(tiny), "--kv-transfer-config", '{"kv_role": "kv_consumer"}',
         "--max-kv-loads-per-step", "2"]
    )  # fmt: skip
    config = build_engine_config(resolve_options(args))
    assert config.kv_transfer.is_consumer and config.kv_transfer.max_kv_loads_per_step == 2
    args = build_parser().parse_args(["serve", str(tiny), "--kv-transfer-config", "{"])
    with pytest.raises(ConfigError, match="not valid JSON"):
        build_engine_config(resolve_options(args))


def test_request_params_are_checked():
    from rackserve.request import KVTransferParams

    with pytest.raises(ValueError, match="transfer_id is required"):
        KVTransferParams.from_dict({"do_remote_decode": True})
    with pytest.raises(ValueError, match="remote_host"):
        KVTransferParams.from_dict({"do_remote_prefill": True, "transfer_id": "x"})
    with pytest.raises(ValueError, match="must be a int"):
        KVTransferParams.from_dict({"remote_port": "80"})
    params = KVTransferParams.from_dict({"do_remote_decode": True, "transfer_id": "t", "x": 1})
    assert params.do_remote_decode and params.num_consumers == 1
    carried = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h",
               "remote_port": 1, "first_token_ids": [3]}  # fmt: skip
    ok = {"token_ids": [3, 9], "logprobs": [-0.5, -2], "rank": 1}
    assert KVTransferParams.from_dict(carried | {"first_logprobs": [ok]}).first_logprobs == (
        ((3, 9), (-0.5, -2.0), 1),
    )
    bads = ({"logprobs": [10**400, -2]}, {"logprobs": [float("inf"), -2]}, {"rank": 2**64},
            {"rank": 0}, {"logprobs": [-0.5]}, {"token_ids": [4, 9]})  # fmt: skip
    for bad in bads:
        with pytest.raises(ValueError, match="first_logprobs"):
            KVTransferParams.from_dict(carried | {"first_logprobs": [ok | bad]})
    with pytest.raises(ValueError, match="first_token_ids"):
        KVTransferParams.from_dict(carried | {"first_token_ids": [2**64]})


def test_engine_without_config_refuses_kv_params(tiny):
    from dataclasses import replace

    from rackserve.request import KVTransferParams

    core = make_core(tiny)
    params = replace(PARAMS, kv_transfer_params=KVTransferParams(True, transfer_id="t"))
    with pytest.raises(ValueError, match="no --kv-transfer-config"):
        core.add_request(EngineCoreRequest("a", [1, 2, 3], params, time.time()))
    assert not core.has_unfinished_requests()
