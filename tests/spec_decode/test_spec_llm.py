"""`LLM(..., speculative_config=...)`: n > 1, seeded sampling with logprobs, and stop strings
or max_tokens landing inside an accepted run give exactly the plain engine's outputs."""

from __future__ import annotations

import pytest

from rackserve.llm import LLM
from rackserve.request import SamplingParams

from spec_utils import target_dir

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps"]


def outputs(llm: LLM, params: SamplingParams) -> list[list[tuple]]:
    """Per prompt, per completion: text, token ids, finish and stop reasons, and the
    cumulative logprob rounded (the verify step batches 4 positions: fp32 noise ~1e-6)."""
    return [
        [
            (
                c.text,
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3),
            )
            for c in out.outputs
        ]
        for out in llm.generate(PROMPTS, params)
    ]


@pytest.fixture(scope="module")
def llms(target_dir):
    kwargs = dict(device="cpu", max_model_len=256, max_num_seqs=8)
    plain = LLM(str(target_dir), **kwargs)
    # a draft identical to the target: runs of K + 1 = 4 tokens per step
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(target_dir)}
    spec = LLM(str(target_dir), speculative_config=draft, **kwargs)
    return plain, spec


def test_n_seeded_with_logprobs(llms):
    plain, spec = llms
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=3)
    want = outputs(plain, params)
    assert outputs(spec, params) == want
    assert all(c[4] is not None for out in want for c in out)
    # greedy drafts against sampled targets: accepted with the target's p(draft) only
    assert spec.engine.scheduler.stats().spec_decoding.num_accepted_tokens > 0


def test_stops_inside_an_accepted_run(llms):
    plain, spec = llms
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = spec.engine.scheduler.stats().spec_decoding.copy()
    assert outputs(spec, greedy) == outputs(plain, greedy)
    greedy_stats = spec.engine.scheduler.stats().spec_decoding.minus(before)
    assert greedy_stats.acceptance_rate == 1.0  # greedy: the identical draft always agrees
    (full,) = outputs(plain, greedy)[:1]
    text = full[0][0]
    assert len(text) > 10
    stop = text[5:8]  # a stop string in the middle of the text (of a run of 4 tokens)
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # 6 = 4 + 2
    ):
        want = outputs(plain, params)
        assert outputs(spec, params) == want
    assert want[0][0][2] == "length" and len(want[0][0][1]) == 6


def test_structured_requests_beside_speculating_ones(llms):
    """A constrained request never drafts (its grammar advances one token a step); in the
    same batch, free requests verify their drafts. Outputs as without speculation."""
    from rackserve.request import StructuredOutputsParams

    plain, spec = llms
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    choice = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-c]{5}")
    )
    prompts = ["Answer:", "Count:", "Free text:"]
    params = [choice, free, choice]
    want = [o.outputs[0].text for o in plain.generate(prompts, params)]
    got = [o.outputs[0].text for o in spec.generate(prompts, params)]
    assert got == want
    assert len(want[0]) == 5 and set(want[0]) <= set("abc")
