"""The offline API: vLLM-shaped results, n > 1 sharing the prompt's blocks, logprobs."""

from __future__ import annotations

import math

import pytest

from rackserve import LLM, SamplingParams
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)
    return LLM(str(path), max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048)


def test_generate_shapes_and_order(llm):
    prompts = ["Hello world", [5, 6, 7, 8, 9], {"prompt_token_ids": [10, 11, 12]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.prompt for o in outs] == ["Hello world", None, None]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8, 9]
    for out in outs:
        (completion,) = out.outputs
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
    # greedy is deterministic across calls and batch compositions
    again = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_n_completions_share_the_prompt_blocks(llm):
    prompt = list(range(100, 300))  # 200 tokens: 192 aligned to the 32-token blocks
    kv = llm.engine.scheduler.kv
    hits_before = kv.stats.num_hit_tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds 7, 8, 9, 10
    # children 1..3 start after child 0 computed the prompt, and hit its blocks
    assert kv.stats.num_hit_tokens - hits_before == 3 * 192
    (same,) = llm.generate({"prompt_token_ids": prompt}, params)
    assert [c.token_ids for c in same.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate({"prompt_token_ids": [20, 21, 22, 23, 24]}, params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry.token_id == token_id and entry.rank == 1  # greedy picks the best
        assert len(entry.top) == 3 and entry.top[0][0] == token_id
        assert entry.logprob <= 0
    assert math.isclose(
        completion.cumulative_logprob, sum(e.logprob for e in completion.logprobs), rel_tol=1e-5
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    assert [e.token_id for e in out.prompt_logprobs[1:]] == [21, 22, 23, 24]


def test_chat_uses_the_template(llm):
    (out,) = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3)
    )
    assert out.prompt.endswith("<｜Assistant｜>")
    assert len(out.outputs[0].token_ids) <= 3


def test_long_prefill_token_threshold_leaves_greedy_tokens(llm, tmp_path):
    """A 300-token prompt prefilled 32 tokens a step gives the tokens of one whole step."""
    path = create_checkpoint(tiny_config(), tmp_path / "tiny", seed=0)
    chunked = LLM(str(path), max_num_seqs=16, max_model_len=2048, long_prefill_token_threshold=32)
    prompt = [{"prompt_token_ids": [10 + (i * 37) % 3000 for i in range(300)]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert chunked.generate(prompt, params)[0].outputs[0].token_ids == want
    assert chunked.engine.scheduler.config.long_prefill_token_threshold == 32
