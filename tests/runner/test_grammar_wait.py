"""A slow grammar compile stalls nobody: the request waits in the scheduler
(WAITING_FOR_FSM) while others step, runs once compiled, and fails alone, freeing
everything, when the compile outlives --structured-output-timeout-s."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
from transformers import AutoTokenizer

from rackserve.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import Request, RequestStatus, SamplingParams, StructuredOutputsParams
from rackserve.runner.structured_output import GrammarWait

CHOICE = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(num_layers=2)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("tiny"), seed=0, with_mtp=False)


def _engine(model_dir, timeout_s: float = 30.0) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=16 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
        device="cpu",
        structured_output_timeout_s=timeout_s,
    )
    return EngineCore(config, log_stats=False)


def _slow_compiles(core: EngineCore) -> threading.Event:
    """Every compile of ``core`` waits for the returned event (a pathological schema)."""
    release = threading.Event()
    compile_now = core.grammar_compiler._compile

    def slow(grammar):
        release.wait(60)
        return compile_now(grammar)

    core.grammar_compiler._compile = slow  # type: ignore[method-assign]
    return release


def _add(core: EngineCore, req_id: str, structured: StructuredOutputsParams | None) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, structured_outputs=structured
    )
    core.add_request(EngineCoreRequest(req_id, [5, 6, 7, 8], params, time.time()))


def test_grammar_wait_polls_ready_failed_and_late() -> None:
    wait = GrammarWait()
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(), eos_token_ids=(1,)) for i in range(4)]
    ready, failed, slow, dropped = Future(), Future(), Future(), Future()
    wait.add(reqs[0], ready, 30)
    wait.add(reqs[1], failed, 30)
    wait.add(reqs[2], slow, 0.01)
    wait.add(reqs[3], dropped, 30)
    wait.discard("r3")  # aborted while compiling
    assert wait.poll() == ([], []) and len(wait) == 3
    ready.set_result("compiled")
    failed.set_exception(RuntimeError("boom"))
    time.sleep(0.02)
    now_ready, now_failed = wait.poll()
    assert now_ready == [reqs[0]]
    assert [(r.request_id, "boom" in m) for r, m in now_failed] == [("r1", True), ("r2", False)]
    assert "did not compile within 0.01 s" in now_failed[1][1]
    assert len(wait) == 0 and wait.poll() == ([], [])


def test_slow_compile_does_not_stall_other_requests(tiny) -> None:
    core = _engine(tiny)
    release = _slow_compiles(core)
    try:
        _add(core, "constrained", CHOICE)
        _add(core, "plain", None)
        assert core.scheduler.requests["constrained"].status == RequestStatus.WAITING_FOR_FSM
        tokens: dict[str, list[int]] = {"constrained": [], "plain": []}
        finished: set[str] = set()
        for _ in range(10):  # the plain request runs to its end while the grammar compiles
            start = time.monotonic()
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished.add(out.request_id)
            assert time.monotonic() - start < 5  # no step waits for the compile
            if "plain" in finished:
                break
        assert finished == {"plain"} and len(tokens["plain"]) == 4
        assert tokens["constrained"] == [] and core.scheduler.stats().num_waiting_reqs == 1
        release.set()
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                assert out.error is None
        text = AutoTokenizer.from_pretrained(tiny).decode(tokens["constrained"])
        assert text.startswith(("yes", "no")), text  # the grammar held once compiled
    finally:
        release.set()
        core.shutdown()


def test_compile_past_the_deadline_fails_that_request_alone(tiny) -> None:
    core = _engine(tiny, timeout_s=0.3)
    release = _slow_compiles(core)
    try:
        _add(core, "constrained", CHOICE)
        _add(core, "plain", None)
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step().outputs
            time.sleep(0.02)
        failed = [o for o in outputs if o.request_id == "constrained"]
        assert len(failed) == 1 and failed[0].finish_reason == "abort"
        assert "did not compile within 0.3 s" in failed[0].error
        assert "--structured-output-timeout-s" in failed[0].error
        plain = [t for o in outputs if o.request_id == "plain" for t in o.new_token_ids]
        assert len(plain) == 4
        assert core.scheduler.requests == {} and len(core.scheduler.waiting_for_grammar) == 0
        assert core.scheduler.kv.usage == 0.0  # everything freed
    finally:
        release.set()
        core.shutdown()


def test_abort_while_compiling_frees_the_request(tiny) -> None:
    core = _engine(tiny)
    release = _slow_compiles(core)
    try:
        _add(core, "constrained", CHOICE)
        core.abort_requests(["constrained"])
        assert not core.has_unfinished_requests()
        assert len(core.scheduler.waiting_for_grammar) == 0
        core.step()  # nothing left to admit once compiled
    finally:
        release.set()
        core.shutdown()


def test_timeout_must_be_positive(tiny) -> None:
    with pytest.raises(ConfigError, match="structured-output-timeout-s"):
        _engine(tiny, timeout_s=0)
