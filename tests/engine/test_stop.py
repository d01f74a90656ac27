"""Stop conditions: token-level (engine) and stop strings (detokenizer)."""

from __future__ import annotations

import random

from rackserve.engine.stop import (
    StopDecision,
    check_stop,
    check_stop_strings,
    check_stop_token,
    check_stop_tokens,
    stream_holdback_chars,
)
from rackserve.request import SamplingParams

EOS = [1]


def test_eos_stops_unless_ignored():
    assert check_stop_token(SamplingParams(), 1, 3, EOS) == StopDecision(kind="stop")
    assert check_stop_token(SamplingParams(ignore_eos=True), 1, 3, EOS) is None


def test_stop_token_ids_report_the_token():
    decision = check_stop_token(SamplingParams(stop_token_ids=[42]), 42, 2, EOS)
    assert decision == StopDecision(kind="stop", stop_reason=42)


def test_max_tokens_and_context_length_stop_with_length():
    params = SamplingParams(max_tokens=4)
    assert check_stop_token(params, 7, 3, EOS) is None
    assert check_stop_token(params, 7, 4, EOS) == StopDecision(kind="length")
    assert check_stop_token(SamplingParams(), 7, 2, EOS, num_tokens=100, max_model_len=100) == (
        StopDecision(kind="length")
    )


def test_eos_wins_over_max_tokens():
    assert check_stop_token(SamplingParams(max_tokens=2), 1, 2, EOS) == StopDecision(kind="stop")


def test_nothing_stops_before_min_tokens():
    params = SamplingParams(min_tokens=3, stop_token_ids=[9], stop=["x"])
    assert check_stop_token(params, 1, 2, EOS) is None
    assert check_stop_token(params, 9, 2, EOS) is None
    assert check_stop(params, 5, 2, EOS, text="axb", num_new_chars=1) is None
    assert check_stop_token(params, 1, 3, EOS) == StopDecision(kind="stop")


def test_several_tokens_stop_at_the_first_that_would_alone():
    """check_stop_tokens = check_stop_token on each token appended one by one."""
    rng = random.Random(0)
    for _ in range(2000):
        max_tokens = rng.randint(1, 8)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(3, max_tokens)),
            stop_token_ids=rng.sample(range(2, 6), rng.randint(0, 2)),
            ignore_eos=rng.random() < 0.2,
        )
        tokens = [rng.randint(1, 7) for _ in range(rng.randint(1, 5))]
        num_output, num_tokens, max_model_len = rng.randint(0, 4), rng.randint(5, 12), 14
        expected = None
        for j, token in enumerate(tokens, 1):
            decision = check_stop_token(
                params, token, num_output + j, EOS, num_tokens + j, max_model_len
            )
            if decision is not None:
                expected = (j, decision)
                break
        got = check_stop_tokens(params, tokens, num_output, EOS, num_tokens, max_model_len)
        assert got == expected, (params, tokens, num_output, num_tokens)


def test_stop_string_truncates_text():
    params = SamplingParams(stop=["END"])
    assert check_stop_strings(params, "hello EN", 2) is None
    assert check_stop_strings(params, "hello END and more", 12) == ("END", "hello ")
    keep = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    assert check_stop_strings(keep, "hello END and more", 12) == ("END", "hello END")


def test_stop_string_split_across_tokens_is_found():
    # "E" arrived earlier, "ND" now: the search must start before the new text.
    assert check_stop_strings(SamplingParams(stop=["END"]), "hello END", 2) == ("END", "hello ")


def test_old_text_is_not_searched_again():
    # A match entirely inside text already checked is not reported a second time.
    assert check_stop_strings(SamplingParams(stop=["ab"]), "ab cd", 2) is None


def test_earliest_stop_string_wins():
    params = SamplingParams(stop=["world", "lo"])
    assert check_stop_strings(params, "hello world", 11) == ("lo", "hel")


def test_check_stop_prefers_stop_string_over_length():
    params = SamplingParams(max_tokens=3, stop=["\n\n"])
    decision = check_stop(params, 5, 3, EOS, text="one\n\ntwo", num_new_chars=5)
    assert decision == StopDecision(kind="stop", stop_reason="\n\n", text="one")
    plain = check_stop(params, 5, 3, EOS, text="one two", num_new_chars=4)
    assert plain == StopDecision(kind="length", text="one two")
    assert check_stop(params, 5, 2, EOS, text="one two", num_new_chars=4) is None


def test_stream_holdback():
    assert stream_holdback_chars(SamplingParams()) == 0
    assert stream_holdback_chars(SamplingParams(stop=["ab", "wxyz"])) == 3
    assert stream_holdback_chars(SamplingParams(stop=["ab"], include_stop_str_in_output=True)) == 0
