"""``--async-scheduling`` on the tiny model (CPU): the tokens, logprobs and finish reasons of
mixed requests equal the synchronous engine's (temperature 0 and seeded), through chunked
prefill, prefix hits, stop tokens and strings, max_tokens, aborts between launch and
collect, preemption, n > 1, penalties, structured outputs and the host KV pool; no block
leaks; and with a slow fake device the host work of step N+1 hides behind step N."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from rackserve import LLM
from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from rackserve.engine.async_scheduling import DelayedDevice
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams, StructuredOutputsParams
from rackserve.runner.cuda_graph import DecodeGraphs, PrefillGraphs

from engine_utils import budget_for_tokens

QUARTER = list(range(2, tiny_config().vocab_size, 4))
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def make(model_dir, async_scheduling: bool, kv_tokens: int | None = None, **kw) -> EngineCore:
    seqs, batched = kw.pop("max_num_seqs", 8), kw.pop("max_num_batched_tokens", 64)
    max_len = kw.pop("max_model_len", 512)
    kv = None if kv_tokens is None else budget_for_tokens(model_dir, kv_tokens, seqs, batched)
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=kv, **kw),
        scheduler=SchedulerConfig(seqs, batched, max_len, async_scheduling=async_scheduling),
        device="cpu",
    )
    return EngineCore(config, log_stats=False)


@pytest.fixture(scope="module")
def engines(tiny):
    """(sync, async) engines of the default set-up, shared by the tests (ids differ)."""
    return make(tiny, False), make(tiny, True)


def prompts(n: int, seed: int, shared: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, 500, (shared,), generator=g).tolist()
    return {
        f"p{seed}.{i}": prefix
        + torch.randint(
            2, 500, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g
        ).tolist()
        for i in range(n)
    }


def drive(core, requests, abort_after: dict[str, int] | None = None, max_steps: int = 2000):
    """Submit ``requests`` {id: (prompt, params)}, step until done; per request (tokens,
    logprobs, finish reason). ``abort_after``: abort a request after that many steps (its
    next step is in flight then)."""
    for req_id, (ids, params) in requests.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    out = {r: ([], [], None) for r in requests}
    aborted = set()
    for step in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            assert o.request_id not in aborted, "a token after the abort"
            tokens, lps, _ = out.get(o.request_id, ([], [], None))
            tokens += o.new_token_ids
            lps += [lp.logprobs[0] for lp in o.new_logprobs or ()]
            out[o.request_id] = (tokens, lps, o.finish_reason)
        for req_id, n in (abort_after or {}).items():
            if step + 1 == n:
                core.abort_requests([req_id])
                aborted.add(req_id)
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.usage == 0.0  # no leaked block
    return out


def same(a: dict, b: dict) -> bool:
    """Tokens and finish reasons equal; logprobs equal up to float32 noise (the batches of
    the two engines differ, so do their reduction orders)."""
    assert a.keys() == b.keys()
    for k in a:
        (ta, la, fa), (tb, lb, fb) = a[k], b[k]
        assert (k, ta, fa) == (k, tb, fb)
        assert la == pytest.approx(lb, abs=1e-3), k
    return True


def mixed(seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy, seeded, short/long max_tokens, stop tokens, eos, min_tokens, a penalty."""
    ps = list(prompts(10, seed).values())
    kinds = [
        GREEDY,
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        # a quarter of the vocabulary stops it: it stops within a few steps
        SamplingParams(temperature=0.8, seed=9, max_tokens=16, stop_token_ids=QUARTER),
        SamplingParams(temperature=0, max_tokens=20),  # eos may stop it
        SamplingParams(temperature=1.0, seed=1, max_tokens=9, min_tokens=4, stop_token_ids=QUARTER),
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_tokens=11, presence_penalty=0.5),
        GREEDY,
    ]
    return {f"m{seed}.{i}": (p, k) for i, (p, k) in enumerate(zip(ps, kinds, strict=True))}


def test_mixed_requests_match_sync_with_chunked_prefill_and_prefix_hits(engines):
    waves = [mixed(1), {k: (p, GREEDY) for k, p in prompts(6, 2, shared=80).items()}]
    waves.append({k + "b": (p, GREEDY) for k, p in prompts(6, 2, shared=80).items()})
    results = []
    for core in engines:
        results.append([drive(core, w) for w in waves])
        assert core.scheduler.stats().prefix_cache_hits > 0
    sync, asyn = results
    assert all(same(a, b) for a, b in zip(sync, asyn, strict=True))
    assert any(fr == "stop" for _, _, fr in sync[0].values())  # stop tokens were exercised


def test_fed_tokens_come_from_the_device_and_overlap(engines):
    """Decode steps of the async engine launch before the last step is collected: their
    input ids are placeholders the device fills (counted here)."""
    core = engines[1]
    fed = []
    add = core.runner._add_placeholders
    core.runner._add_placeholders = lambda sched: fed.append(add(sched)) or fed[-1]
    try:
        drive(core, {k: (p, GREEDY) for k, p in prompts(4, 3).items()})
    finally:
        del core.runner._add_placeholders
    assert sum(map(len, fed)) >= 4 * (GREEDY.max_tokens - 2)


def test_graph_decode_steps_take_the_fed_tokens(engines):
    """The CUDA-graph path (here uncaptured, so run eagerly on its static buffers): the
    fed tokens land in the graph's input ids."""
    sync, asyn = engines
    runner = asyn.runner
    runner.graphs = DecodeGraphs(
        asyn.model, runner.caches, runner.buffers, runner.buffers.groups, [1, 2, 4, 8], [512]
    )
    reqs = {k: (p, GREEDY) for k, p in prompts(5, 11).items()}
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: used.append(a[3] is not None) or run(*a)
    try:
        got = drive(asyn, reqs)
    finally:
        runner.graphs = None
    assert sum(used) >= 5 and same(got, drive(sync, reqs))


def test_prompt_logprobs_steps_leave_the_prefill_graphs(engines):
    """The prefill graphs run the hyper head on the sampled rows only: a step holding a
    request that asks for its prompt's logprobs (every row's hidden state) runs eagerly,
    the others from the graphs (uncaptured: eagerly on their static buffers); tokens,
    logprobs and prompt logprobs equal the synchronous engine's without graphs."""
    sync, asyn = engines
    runner = asyn.runner
    runner.prefill_graphs = PrefillGraphs(
        asyn.model, runner.caches, runner.buffers, runner.buffers.groups, [64], [512],
        max_sampled_rows=8,
    )  # fmt: skip
    served = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda *a: served.append(a[1]) or run(*a)
    with_prompt = dataclasses.replace(GREEDY, prompt_logprobs=2)
    ps = list(prompts(4, 29).values())
    reqs = {f"g{i}": (p, with_prompt if i == 1 else GREEDY) for i, p in enumerate(ps)}

    def prompt_logprobs(core) -> list:
        got = []
        for req_id, (ids, params) in reqs.items():
            core.add_request(EngineCoreRequest(f"{req_id}.{id(core)}", ids, params, time.time()))
        while core.has_unfinished_requests():
            got += [o.prompt_logprobs for o in core.step().outputs if o.prompt_logprobs]
        return got

    try:
        got = prompt_logprobs(asyn)
    finally:
        runner.prefill_graphs = None
    want = prompt_logprobs(sync)
    assert len(got) == len(want) == 1 and len(got[0]) == len(ps[1])
    for a, b in zip(got[0][1:], want[0][1:], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert served  # the other requests' steps took the graphs
    assert all(len(i.logits_indices) <= 8 for i in served)
    assert same(drive(asyn, {k + "x": v for k, v in reqs.items() if k != "g1"}),
                drive(sync, {k + "x": v for k, v in reqs.items() if k != "g1"}))  # fmt: skip


def test_prefill_graph_steps_take_the_fed_tokens(engines):
    """The prefill-graph path (uncaptured: run eagerly on its static buffers, every token
    a closing candidate, padded to 64 tokens): chunked prefills and mixed steps whose decode
    tokens the device feeds give the synchronous engine's tokens."""
    sync, asyn = engines
    runner = asyn.runner
    groups = runner.buffers.groups
    runner.prefill_graphs = PrefillGraphs(
        asyn.model, runner.caches, runner.buffers, groups, [64], [512]
    )
    runner.graphs = DecodeGraphs(
        asyn.model, runner.caches, runner.buffers, groups, [1, 2, 4, 8], [512]
    )
    reqs = {k: (p, GREEDY) for k, p in prompts(6, 23).items()}  # not cached by the tests above
    used = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda *a: used.append(a[3] is not None) or run(*a)
    try:
        got = drive(asyn, reqs)
    finally:
        runner.graphs = runner.prefill_graphs = None
    assert len(used) >= 2 and any(used)  # prefill steps, some beside fed decode tokens
    assert same(got, drive(sync, reqs))


def test_aborts_between_launch_and_collect(engines):
    reqs = {k: (p, GREEDY) for k, p in prompts(6, 4).items()}
    expected = drive(engines[0], reqs)
    ids = list(reqs)
    got = drive(engines[1], reqs, abort_after={ids[1]: 3, ids[4]: 6})
    for i in (1, 4):  # a prefix of its tokens, nothing after the abort
        tokens, _, _ = got[ids[i]]
        assert tokens == expected[ids[i]][0][: len(tokens)] and len(tokens) < 10
    assert same(
        {k: v for k, v in got.items() if k not in (ids[1], ids[4])},
        {k: v for k, v in expected.items() if k not in (ids[1], ids[4])},
    )


def test_preemption_small_kv_cache(tiny):
    reqs = {k: (p, GREEDY) for k, p in prompts(8, 5, shared=0).items()}
    reqs |= {k + "s": (p, mixed(6)[f"m6.{i}"][1]) for i, (k, p) in enumerate(prompts(8, 7).items())}
    results = []
    for flag in (False, True):
        core = make(tiny, flag, kv_tokens=300, max_model_len=256)
        results.append(drive(core, reqs))
        assert core.scheduler.num_preemptions > 0
    assert same(*results)


def test_host_kv_pool(tiny):
    """Two turns over a small cache with a host pool: the pool's hits and loads give the
    same tokens."""
    turn1 = {k: (p, GREEDY) for k, p in prompts(8, 8, shared=0).items()}
    results = []
    for flag in (False, True):
        core = make(tiny, flag, kv_tokens=700, kv_offload_memory=64 << 20)
        first = drive(core, turn1)
        turn2 = {k + "t2": (p + first[k][0] + [3, 4, 5], GREEDY) for k, (p, _) in turn1.items()}
        results.append((first, drive(core, turn2)))
        assert core.offload.stats.bytes_offloaded > 0
    assert same(results[0][0], results[1][0]) and same(results[0][1], results[1][1])


@pytest.fixture(scope="module")
def llms(tiny):
    return [
        LLM(str(tiny), max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512,
            async_scheduling=flag)
        for flag in (False, True)
    ]  # fmt: skip


def _texts(results):
    return [[(c.text, c.token_ids, c.finish_reason) for c in r.outputs] for r in results]


def test_llm_stop_strings_and_n(llms):
    sync, asyn = llms
    text = ["the cat sat on", "a b c d e", "hello world, again and"]
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=14, ignore_eos=True)
    free = sync.generate(text, params)
    # stop strings taken from the free-running text: requests end early, mid-step
    stops = [c.text[3:6] for r in free for c in r.outputs if len(c.text) > 6][:4]
    assert stops
    stopped = dataclasses.replace(params, stop=stops)
    expected = _texts(sync.generate(text, stopped))
    assert _texts(asyn.generate(text, stopped)) == expected
    assert any(fr == "stop" for r in expected for _, _, fr in r)
    assert asyn.engine.scheduler.kv.usage == 0.0


def test_llm_structured_outputs_wait_for_their_token(llms):
    sync, asyn = llms
    choice = StructuredOutputsParams(choice=["yes please", "no thanks", "maybe"])
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=choice)
        for s in range(3)
    ] + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    text = ["answer:", "question?", "x", "plain"]
    expected = _texts(sync.generate(text, params))
    assert _texts(asyn.generate(text, params)) == expected
    assert {r[0][0] for r in expected[:3]} <= {"yes please", "no thanks", "maybe"}


def test_refuses_speculative_decoding(tiny):
    config = EngineConfig(
        model=str(tiny),
        model_config=ModelConfig.from_pretrained(tiny),
        scheduler=SchedulerConfig(max_model_len=512, async_scheduling=True),
        speculative=SpecConfig.from_json({"method": "mtp", "num_speculative_tokens": 1}),
        device="cpu",
    )
    with pytest.raises(ValueError, match="async-scheduling does not support speculative"):
        EngineCore(config, log_stats=False)


def test_on_by_default_where_supported(tiny):
    """Unset (None), as vLLM's default: on for a plain engine on a GPU; off (no error) with
    speculative decoding or EP, and on the CPU (the forward runs inline there: nothing to
    overlap); False keeps an engine synchronous."""
    from rackserve.config import ParallelConfig
    from rackserve.engine.async_scheduling import is_async

    def config(**kw) -> EngineConfig:
        sched = SchedulerConfig(max_model_len=512, async_scheduling=kw.pop("asked", None))
        return EngineConfig(
            model=str(tiny), model_config=ModelConfig.from_pretrained(tiny), scheduler=sched,
            device="cpu", **kw,
        )  # fmt: skip

    mtp = SpecConfig.from_json({"method": "mtp", "num_speculative_tokens": 1})
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert SchedulerConfig().async_scheduling is None
    assert is_async(config(), gpu) and not is_async(config(asked=False), gpu)
    assert not is_async(config(speculative=mtp), gpu)
    assert not is_async(config(parallel=ParallelConfig(enable_expert_parallel=True)), gpu)
    assert not is_async(config(), cpu) and is_async(config(asked=True), cpu)
    assert not EngineCore(config(), log_stats=False).async_scheduling
    assert EngineCore(config(asked=True), log_stats=False).async_scheduling


# large next to the tiny model's real forward and host work, even on a loaded machine
FORWARD_S, HOST_S = 0.15, 0.1


def _mean_decode_step_s(core: EngineCore, num_steps: int) -> tuple[float, dict]:
    """Mean wall time of decode steps, with a device taking FORWARD_S per step (its own
    thread) and schedule() taking HOST_S more on the host; and the requests' outputs.
    The requests are admitted with their KV in place (``bench decode``, P/D decode side)."""
    core.runner.device_queue = DelayedDevice(FORWARD_S)
    schedule = core.scheduler.schedule

    def slow_schedule():
        time.sleep(HOST_S)
        return schedule()

    core.scheduler.schedule = slow_schedule
    params = SamplingParams(temperature=0, max_tokens=num_steps + 4, ignore_eos=True, logprobs=0)
    for k, p in prompts(4, 10).items():
        assert core.add_request_with_kv(EngineCoreRequest(k, p, params, time.time()), len(p) - 1)
    outputs = {k: ([], [], None) for k in prompts(4, 10)}

    def step():
        for o in core.step().outputs:
            tokens, lps, _ = outputs[o.request_id]
            outputs[o.request_id] = (
                tokens + o.new_token_ids,
                lps + [lp.logprobs[0] for lp in o.new_logprobs or ()],
                o.finish_reason,
            )

    for _ in range(2):  # the pipeline's first step
        step()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    took = (time.perf_counter() - start) / num_steps
    core.scheduler.schedule = schedule
    while core.has_unfinished_requests():
        step()
    assert core.scheduler.kv.usage == 0.0
    core.shutdown()
    return took, outputs


def test_overlap_with_a_slow_fake_device(tiny):
    """Sync: a step costs forward + host. Async: about max(forward, host)."""
    sync, expected = _mean_decode_step_s(make(tiny, False), 6)
    asyn, got = _mean_decode_step_s(make(tiny, True), 6)
    assert same(got, expected)
    assert sync >= FORWARD_S + HOST_S
    assert asyn < FORWARD_S + HOST_S * 0.5 and asyn < sync - HOST_S * 0.5, (sync, asyn)


def test_flags(tiny):
    """``serve`` and ``generate`` take --async-scheduling and --no-async-scheduling; unset
    (None: on where supported) by default."""
    from rackserve.cli import build_parser
    from rackserve.server.options import build_engine_config, resolve_options

    def serve(*argv: str) -> EngineConfig:
        args = build_parser().parse_args(["serve", str(tiny), "--max-model-len", "256", *argv])
        return build_engine_config(resolve_options(args))

    assert serve().scheduler.async_scheduling is None
    assert serve("--async-scheduling").scheduler.async_scheduling is True
    assert serve("--no-async-scheduling").scheduler.async_scheduling is False
    for flag, want in (
        ((), None),
        (("--async-scheduling",), True),
        (("--no-async-scheduling",), False),
    ):
        args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flag])
        assert args.async_scheduling is want


def test_penalties_count_the_token_in_flight_without_waiting(engines):
    """A penalty request gets a placeholder like any other: the runner writes the token in
    flight over it in the penalties' output ids, on the device. A frequency penalty of -2
    (each earlier output token pulled up by 2 a use) makes that token matter at every step
    (greedy, it changes the tiny model's tokens): async equals sync; and the request takes
    about one step a token, not two."""
    forbid = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=-2.0, ignore_eos=True)
    free = dataclasses.replace(forbid, frequency_penalty=0.0)
    ps = prompts(4, 7)
    penalised = {k: (p, forbid) for k, p in ps.items()}
    sync, asyn = engines
    want = drive(sync, penalised)
    plain = drive(sync, {k + "f": (p, free) for k, p in ps.items()})
    assert any(want[k][0] != plain[k + "f"][0] for k in ps)  # the penalty changes tokens
    assert same(drive(asyn, {k + "a": v for k, v in penalised.items()}), {
        k + "a": v for k, v in want.items()
    })  # fmt: skip
    asyn.add_request(EngineCoreRequest("one", ps[next(iter(ps))], forbid, time.time()))
    steps = 0
    while asyn.has_unfinished_requests():
        asyn.step()
        steps += 1
    assert steps <= forbid.max_tokens + 3, steps
