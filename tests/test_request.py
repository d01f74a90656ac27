"""SamplingParams normalisation and validation."""

from __future__ import annotations

import pytest

from rackserve.request import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (16, 0, None)
    assert params.stop == [] and params.stop_token_ids == []
    assert not params.is_greedy and not params.has_penalties


def test_aliases_are_normalised():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_params_are_immutable():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "raise max_tokens or lower min_tokens"),
        ({"logprobs": 21}, r"logprobs must be None or in \[0, 20\]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_fix(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
