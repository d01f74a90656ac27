"""Prefix caching across agent turns, seeded sampling and KV export/import, on the tiny
model created by `model create` (no reference needed: these compare the engine with
itself or with the cache's theoretical best)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from transformers import AutoTokenizer

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.kv_budget import plan_kv_cache
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import capacity_tokens
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams

from engine_utils import budget_for_tokens, make_engine, run_to_completion


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def test_agent_sessions_hit_while_long_requests_churn(tiny):
    """10 sessions x 6 turns (next prompt = prompt + output + new text), interleaved, while
    long requests churn the sliding-window pages of a small cache."""
    core = make_engine(tiny, max_num_seqs=16, max_num_batched_tokens=512, kv_tokens=12_000)
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(10, 4000, (n,), generator=g).tolist()

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = {f"s{i}": rand(int(torch.randint(60, 200, (1,), generator=g))) for i in range(10)}
    total_prompt = theoretical = measured = 0
    for turn in range(6):
        churn = {f"long{turn}_{k}": rand(1500) for k in range(2)}
        for req_id, ids in {**churn, **prompts}.items():
            core.add_request(EngineCoreRequest(f"{req_id}_t{turn}", ids, params, time.time()))
        outputs = {f"{r}_t{turn}": [] for r in prompts}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                if out.request_id in outputs:
                    if not outputs[out.request_id]:
                        measured += out.num_cached_tokens
                    outputs[out.request_id] += out.new_token_ids
        for req_id, ids in prompts.items():
            total_prompt += len(ids)
            output = outputs[f"{req_id}_t{turn}"]
            if turn < 5:
                new_text = rand(int(torch.randint(20, 80, (1,), generator=g)))
                prompts[req_id] = ids + output + new_text
                theoretical += len(ids) + len(output)  # what turn + 1 could reuse
    theoretical_rate = theoretical / total_prompt
    assert measured / total_prompt >= 0.9 * theoretical_rate, (measured, theoretical)
    assert core.scheduler.kv.usage == 0.0


def test_chat_template_turns_hit_the_previous_prompt(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    core = make_engine(tiny)
    params = SamplingParams(temperature=0, max_tokens=12)
    messages = [{"role": "system", "content": "You are a coding agent. " * 8}]
    previous: list[int] = []
    alignment = core.scheduler.kv.alignment
    for turn in range(4):
        messages.append({"role": "user", "content": f"Run step {turn}: " + "ls -la; " * 12})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids[: len(previous)] == previous  # the template's round trip
        core.add_request(EngineCoreRequest(f"t{turn}", ids, params, time.time()))
        out_ids, cached = [], None
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                cached = out.num_cached_tokens if cached is None else cached
                out_ids += out.new_token_ids
        if turn:
            assert cached >= len(previous) // alignment * alignment - alignment
            assert cached > 0
        reply = tokenizer.decode(out_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        previous = ids


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    prompt = list(range(20, 80))
    alone = run_to_completion(make_engine(tiny), {"x": prompt}, seeded)["x"]
    core = make_engine(tiny)
    others = {f"o{i}": list(range(30 + i, 90 + i)) for i in range(5)}
    batched = run_to_completion(core, {**others, "x": prompt}, seeded)["x"]
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12)
    assert run_to_completion(make_engine(tiny), {"x": prompt}, other_seed)["x"] != alone


@pytest.mark.parametrize("seed", [1234, None], ids=["seeded", "unseeded"])
def test_sampled_text_survives_preemption(tiny, seed):
    """Random sampling under a KV budget that preempts gives the tokens of an unconstrained
    run: the noise is keyed by (seed, position), and an unseeded request keeps the seed the
    runner drew for it when it first joined."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
    prompts = {f"r{i}": [(7 * i + 3 * t) % 500 + 2 for t in range(100)] for i in range(8)}
    sizes = {"max_num_batched_tokens": 128, "max_model_len": 256}
    roomy = run_to_completion(make_engine(tiny, **sizes), prompts, params)
    tight = make_engine(tiny, **sizes, kv_tokens=400)
    assert run_to_completion(tight, prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert len({t for tokens in roomy.values() for t in tokens}) > 40  # it really samples


def test_engine_refuses_a_cache_smaller_than_one_max_model_len_request(tiny):
    """A request could grow past the whole cache and never finish: refuse to start, with
    one line naming the fix, and the size it names is enough."""
    model_config = ModelConfig.from_pretrained(tiny)
    scheduler = SchedulerConfig(max_num_batched_tokens=256, max_model_len=2048)
    budget = budget_for_tokens(tiny, 540, scheduler.max_num_seqs, 256)

    def config(kv_bytes: int) -> EngineConfig:
        cache = CacheConfig(kv_cache_memory=kv_bytes)
        return EngineConfig(str(tiny), model_config, cache, scheduler, device="cpu")

    with pytest.raises(ValueError, match="max-model-len") as refused:
        plan_kv_cache(config(budget), torch.float32, budget)
    message = str(refused.value)
    assert "\n" not in message and "--kv-cache-memory" in message
    suggested = int(re.search(r"at least (\d+) bytes", message).group(1))
    groups, num_blocks = plan_kv_cache(config(suggested), torch.float32, suggested)
    assert capacity_tokens(groups, num_blocks) >= 2048


def prompt_logprobs_of(core, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Every prompt_logprobs message each request got (there must be exactly one)."""
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    got: dict[str, list] = {req_id: [] for req_id in prompts}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.prompt_logprobs is not None:
                got[out.request_id].append(out.prompt_logprobs)
    return got


def test_prompt_logprobs_are_whole_on_a_prefix_hit_and_after_preemption(tiny):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    prompt = [(5 * t) % 400 + 2 for t in range(91)]
    core = make_engine(tiny)
    (first,) = prompt_logprobs_of(core, {"a": prompt}, params)["a"]
    (again,) = prompt_logprobs_of(core, {"b": prompt}, params)["b"]  # the cache holds it
    assert len(first) == 91 and first[0] is None
    assert [lp.token_ids[0] for lp in first[1:]] == prompt[1:]  # entry j scores token j
    assert all(len(lp.token_ids) == 3 and lp.rank >= 1 for lp in first[1:])
    assert again == first

    sizes = {"max_num_batched_tokens": 128, "max_model_len": 256}
    prompts = {f"r{i}": [(7 * i + 3 * t) % 500 + 2 for t in range(100)] for i in range(8)}
    roomy = prompt_logprobs_of(make_engine(tiny, **sizes), prompts, params)
    tight = make_engine(tiny, **sizes, kv_tokens=400)
    preempted = prompt_logprobs_of(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for req_id, ids in prompts.items():
        (expected,), (got,) = roomy[req_id], preempted[req_id]
        assert len(got) == len(ids) and got[0] is None
        for a, b in zip(expected[1:], got[1:], strict=True):
            assert a.token_ids == b.token_ids and a.rank == b.rank
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_kv_export_import_round_trip(tiny):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = list(range(5, 205))
    expected = run_to_completion(make_engine(tiny), {"x": prompt}, params)["x"]

    core = make_engine(tiny)
    core.add_request(EngineCoreRequest("x", prompt, params, time.time()))
    tokens = []
    while not tokens:  # run the prefill
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    block_ids, packed = core.export_kv("x")
    assert all(len(ids) for ids in block_ids)
    saved = packed.clone()
    core.import_kv("x", torch.zeros_like(packed))  # wipe the request's KV ...
    assert core.export_kv("x")[1].abs().sum() == 0
    core.import_kv("x", saved)  # ... and restore it from the packed region
    assert torch.equal(core.export_kv("x")[1], saved)
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert tokens == expected
