"""Structured output in the runner: grammars, the per-request matchers and their bitmask
rows, rebuild after preemption, and constrained generation through the offline LLM and
the engine core (the tiny random model, so only the grammar makes the output valid)."""

from __future__ import annotations

import json
import time

import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rackserve import LLM
from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import (
    CachedRequestData,
    EngineCoreRequest,
    NewRequestData,
    SchedulerOutput,
)
from rackserve.kv.spec import cache_groups_for, plan_num_blocks
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams, StructuredOutputsParams
from rackserve.runner.input_batch import RunnerRequest
from rackserve.runner.structured_output import (
    GrammarCompiler,
    StructuredOutputs,
    build_grammar,
    check_structured_outputs,
)

EOS = 1
VOCAB_SIZE = tiny_config().vocab_size
# Every part bounded (string lengths, numbers, item counts), so a random model must end
# within a few hundred tokens: only the grammar can make its output valid.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y", None]},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(str(tiny), VOCAB_SIZE, [EOS])


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=1024)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB_SIZE]).tolist())


# ---- parameters and grammars ------------------------------------------------------------


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json="{}", regex="a")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    p = StructuredOutputsParams(json={"type": "object", "b": 1, "a": 2})
    assert p.json == '{"type": "object", "b": 1, "a": 2}'  # key order kept: property order
    assert p.kind == "json" and p.key() == ("json", p.json, False)
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(json={"type": "strin"}), 'invalid JSON schema.*"strin"'),
        (StructuredOutputsParams(json="not json"), "invalid JSON schema.*parse JSON"),
        (StructuredOutputsParams(regex="a(b"), "invalid regex.*parenthesis is not closed"),
        (StructuredOutputsParams(grammar="root ::= foo"), 'invalid grammar.*"foo"'),
    ],
)
def test_invalid_grammars_are_clear_value_errors(params, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_structured_outputs(params)
    assert ".cc:" not in str(info.value) and "[" not in str(info.value)[:30]


def test_bounded_json_strings_refuse_control_characters(compiler, tokenizer) -> None:
    import xgrammar as xgr

    params = StructuredOutputsParams(json=SCHEMA)
    assert "x1f" in str(build_grammar(params))
    matcher = xgr.GrammarMatcher(compiler.compiled(params))
    assert matcher.accept_string('{"name":"ab')
    assert not matcher.accept_string("\x11")  # JSON needs it escaped
    assert matcher.accept_string('c","age":7,"ok":true,"tags":["a"]}')


def test_compiler_caches_by_key(compiler) -> None:
    a = compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert compiler.submit(StructuredOutputsParams(regex="[0-9]+")) is a
    loose = compiler.submit(StructuredOutputsParams(json_object=True))
    strict = compiler.submit(StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    assert loose is not strict and loose.result() is not None


def test_missing_tokenizer_refuses_later_requests(tmp_path) -> None:
    compiler = GrammarCompiler(str(tmp_path / "nothing"), VOCAB_SIZE, [EOS])
    with pytest.raises(OSError):  # the first request's compilation fails (runner logs it)
        compiler.compiled(StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="structured output is unavailable: no tokenizer"):
        compiler.submit(StructuredOutputsParams(regex="b"))  # the next ones get a 400


# ---- the runner's matchers ----------------------------------------------------------------


def _step(new=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(
        new_reqs=list(new),
        cached_reqs=CachedRequestData(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def _new(req_id: str, token_ids: list[int], num_prompt: int, params: SamplingParams):
    return NewRequestData(req_id, token_ids, num_prompt, params, ([],), 0)


def test_rows_eos_and_rebuild_after_preemption(compiler, tokenizer) -> None:
    structured = StructuredOutputs(compiler, 4, VOCAB_SIZE, torch.device("cpu"))
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    plain = SamplingParams()
    prompt = [5, 6, 7]
    a = RunnerRequest("a", list(prompt), len(prompt), choice)
    b = RunnerRequest("b", list(prompt), len(prompt), plain)
    structured.update(_step([_new("a", prompt, 3, choice), _new("b", prompt, 3, plain)]))
    assert structured.bitmask([b]) is None  # no constrained row: nothing to upload
    mask = structured.bitmask([a, b])
    assert mask is not None and mask.shape == (2, (VOCAB_SIZE + 31) // 32)
    assert bool((mask[1] == -1).all())  # the unconstrained row is all ones
    first = allowed(mask, 0)
    assert EOS not in first and tokenizer.encode("y", add_special_tokens=False)[0] in first

    y = tokenizer.encode("y", add_special_tokens=False)
    assert len(y) == 1
    structured.advance([a, b], [y[0], 42])
    a.token_ids.append(y[0])
    after_y = allowed(structured.bitmask([a]), 0)
    assert EOS not in after_y  # "y" is not yet a choice

    # preempted, then resumed with its output so far: the rebuilt matcher is where it was
    structured.update(_step(preempted=["a"]))
    assert "a" not in structured.matchers
    structured.update(_step([_new("a", a.token_ids, 3, choice)]))
    assert allowed(structured.bitmask([a]), 0) == after_y

    es = tokenizer.encode("es", add_special_tokens=False)
    for t in es:
        structured.advance([a], [t])
    assert allowed(structured.bitmask([a]), 0) == {EOS}  # complete: only EOS
    structured.advance([a], [EOS])
    assert structured.bitmask([a]) is None  # terminated: no longer constrains
    structured.update(_step(finished=["a", "b"]))
    assert not structured.matchers


# ---- generation -------------------------------------------------------------------------


def test_json_schema_output_always_validates(llm) -> None:
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=400,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        )
        for seed in range(24)
    ]
    outs = llm.generate(["Describe a person as JSON:"] * len(params), params)
    texts = set()
    for out in outs:
        (c,) = out.outputs
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.add(c.text)
    assert len(texts) > 20  # it really samples


def test_choice_regex_and_grammar(llm) -> None:
    cases = [
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), r"yes|no|maybe so"),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
        (StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"'), r"\([a-c]+\)"),
        (StructuredOutputsParams(grammar='start: "x" NUM\nNUM: /[0-9]/'), r"x[0-9]"),
    ]
    import re

    for so, pattern in cases:
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so)
            for s in range(6)
        ]
        for out in llm.generate(["Answer:"] * 6, params):
            assert re.fullmatch(pattern, out.outputs[0].text), (so, out.outputs[0].text)


def test_json_object_output_parses(llm, tokenizer) -> None:
    # Any object: keys and strings are unbounded, so a random model needs a push to close
    # them; the grammar alone must make what it writes parse.
    push = {tokenizer.encode(t, add_special_tokens=False)[0]: 6.0 for t in ('"', "}")}
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=400,
            logit_bias=push,
            structured_outputs=StructuredOutputsParams(json_object=True),
        )
        for s in range(8)
    ]
    for out in llm.generate(["JSON:"] * 8, params):
        assert out.outputs[0].finish_reason == "stop"
        assert isinstance(json.loads(out.outputs[0].text), dict)


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The cache", "Experts route", [9, 10, 11, 12]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    constrained = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=300,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    mixed = llm.generate(prompts + ["JSON:"] * 4, [greedy] * 3 + [constrained] * 4)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_invalid_grammar_is_refused_before_it_runs(llm) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]"))
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate("x", bad)
    ok = llm.generate("x", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(ok[0].outputs[0].token_ids) == 4  # the engine is unharmed


def _engine(model_dir, kv_tokens: int | None) -> EngineCore:
    """An engine whose full-history cache groups hold about ``kv_tokens`` tokens."""
    model_config = ModelConfig.from_pretrained(model_dir)
    num_seqs, num_batched = 32, 128
    budget = None
    if kv_tokens is not None:
        groups = cache_groups_for(model_config, dtype_bytes=4)
        minimum = plan_num_blocks(groups, 1 << 40, num_seqs, num_batched)
        sliding = sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
        full = [g for g in groups if not g.is_sliding]
        budget = int(
            sliding
            + sum(2 * g.bytes_per_block for g in full)
            + kv_tokens * sum(g.bytes_per_token for g in full)
        )
    config = EngineConfig(
        model=str(model_dir),
        model_config=model_config,
        cache=CacheConfig(kv_cache_memory=budget),
        scheduler=SchedulerConfig(
            max_num_seqs=num_seqs, max_num_batched_tokens=num_batched, max_model_len=512
        ),
        device="cpu",
    )
    return EngineCore(config, log_stats=False)


def _run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    out: dict[str, list[int]] = {r: [] for r in prompts}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            out[o.request_id] += o.new_token_ids
    return out


def test_constrained_output_survives_preemption(tiny, tokenizer) -> None:
    """Under a KV budget that preempts, constrained requests recompute to the tokens of a
    roomy run: the rebuilt matchers replay the same grammar states."""
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    prompts = {f"r{i}": [(7 * i + 3 * t) % 500 + 8 for t in range(100)] for i in range(8)}
    roomy = _run(_engine(tiny, None), prompts, params)
    tight = _engine(tiny, 500)
    assert _run(tight, prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    for tokens in roomy.values():
        assert tokens[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)
