"""The agentic trace generator: determinism, prefix-sharing structure, lengths."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from rackserve.bench.metrics import prefix_hits, theoretical_hit_rate, trace_stats
from rackserve.bench.workloads import (
    AgenticConfig,
    PlannedRequest,
    WordCounter,
    generate_session,
    iter_sessions,
    load_token_counter,
    make_text,
    plan_requests,
)
from rackserve.config import ConfigError

SMALL = AgenticConfig(
    system_prompt_tokens=100,
    user_context_tokens=50,
    first_message_tokens=10,
    tool_output_tokens=20,
    output_tokens=5,
    turns=6,
    subagent_probability=0.5,
)


def test_sessions_are_a_pure_function_of_config_and_index() -> None:
    assert generate_session(SMALL, 3) == generate_session(SMALL, 3)
    sessions = iter_sessions(SMALL, start=2)
    assert [next(sessions) for _ in range(3)] == [generate_session(SMALL, i) for i in (2, 3, 4)]
    assert trace_stats(SMALL, 8) == trace_stats(SMALL, 8)
    other_seed = AgenticConfig(**{**SMALL.__dict__, "seed": 1})
    assert generate_session(other_seed, 3).turns != generate_session(SMALL, 3).turns


def test_users_share_only_the_system_prompt() -> None:
    a, b = generate_session(SMALL, 0), generate_session(SMALL, 1)
    assert a.system_prompt == b.system_prompt
    assert len(a.system_prompt.split()) == 100
    assert a.user_context != b.user_context
    assert a.user_context.split()[0] == b.user_context.split()[0] == "user"
    assert a.user_context.split()[1] != b.user_context.split()[1]  # diverge at once
    config = AgenticConfig(**{**SMALL.__dict__, "sessions_per_user": 2})
    first, second, third = (generate_session(config, i) for i in range(3))
    assert first.user_context == second.user_context != third.user_context
    assert first.turns != second.turns


def test_each_turn_extends_the_previous_conversation() -> None:
    session = generate_session(SMALL, 0)
    top = [r for r in plan_requests(session) if r.session_id == session.session_id]
    assert len(top) == len(session.turns)
    for previous, current in itertools.pairwise(top):
        assert current.prompt[: len(previous.prompt) + 1] == (*previous.prompt, previous.output)
    assert top[0].prompt[0] == ("system", 100)


def test_subagents_fork_from_the_parent_context_and_report_back() -> None:
    session = next(s for s in iter_sessions(SMALL) if any(t.subagents for t in s.turns))
    k = next(i for i, t in enumerate(session.turns) if t.subagents)
    requests = plan_requests(session)
    parent = {r.turn: r for r in requests if r.session_id == session.session_id}
    fork_context = (*parent[k].prompt, parent[k].output)
    for sub in session.turns[k].subagents:
        assert sub.parent_id == session.session_id
        assert all(not t.subagents for t in sub.turns)  # no nested fan-out
        sub_requests = [r for r in requests if r.session_id == sub.session_id]
        assert len(sub_requests) == len(sub.turns)
        assert sub_requests[0].prompt[: len(fork_context)] == fork_context
        assert sub_requests[-1].output in parent[k + 1].prompt  # results come back
    assert len(session.turns[k].subagents) == SMALL.subagent_fanout


def test_theoretical_hit_rate_matches_a_hand_computed_trace() -> None:
    config = AgenticConfig(
        system_prompt_tokens=100,
        user_context_tokens=50,
        first_message_tokens=10,
        tool_output_tokens=20,
        output_tokens=5,
        turns=2,
        subagent_probability=0.0,
        length_jitter=0.0,
    )
    # User context: "user <id>" + 50 words = 52. Turn 0: 100 + 52 + 10 = 162 tokens;
    # turn 1 adds reply 0 and a tool output: 162 + 5 + 20 = 187, of which 162 + 5 cached.
    # Session 0 starts cold; session 1 (another user) reuses the 100 system tokens.
    hits, total = 0 + 167 + 100 + 167, 2 * (162 + 187)
    assert trace_stats(config, 2)["theoretical_prefix_hit_rate"] == pytest.approx(hits / total)
    assert trace_stats(config, 2)["num_requests"] == 4


def test_prefix_hits_on_a_small_trie() -> None:
    requests = [
        PlannedRequest("a", 0, (("sys", 10), ("a0", 5)), ("a0o", 3)),
        PlannedRequest("a", 1, (("sys", 10), ("a0", 5), ("a0o", 3), ("a1", 4)), ("a1o", 3)),
        PlannedRequest("b", 0, (("sys", 10), ("b0", 7)), ("b0o", 3)),
        PlannedRequest("c", 0, (("other", 10),), ("c0o", 3)),
    ]
    assert prefix_hits(requests) == [0, 18, 10, 0]
    assert theoretical_hit_rate(requests) == pytest.approx(28 / (15 + 22 + 17 + 10))


def test_agentic_traces_have_high_hit_rates() -> None:
    assert trace_stats(AgenticConfig(), 16)["theoretical_prefix_hit_rate"] > 0.85


def test_lengths_scale_and_jitter_stay_in_range() -> None:
    half = AgenticConfig(**{**SMALL.__dict__, "scale": 0.5, "length_jitter": 0.0})
    session = generate_session(half, 0)
    assert session.num_system_tokens == 50
    assert all(t.output_tokens == 2 for t in session.turns)  # round(5 * 0.5) = 2
    for turn in generate_session(SMALL, 1).turns[1:]:
        assert 10 <= turn.num_content_tokens <= 30
        assert len(turn.content.split()) == turn.num_content_tokens


@dataclass(frozen=True)
class FourCharCounter:
    """A tokenizer stand-in with multi-token words: one token per 4 characters."""

    def count(self, text: str) -> int:
        return len(text) // 4


def test_make_text_sizes_text_with_a_counter() -> None:
    assert WordCounter().count(make_text(random.Random(0), 37)) == 37
    counter = FourCharCounter()
    for target in (5, 50, 300):
        assert abs(counter.count(make_text(random.Random(target), target, counter)) - target) <= 2


def test_load_token_counter_reads_a_tokenizer_json(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"the": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = load_token_counter(tmp_path)
    assert counter.count("the of the cache") == 4
    with pytest.raises(FileNotFoundError):
        load_token_counter(tmp_path / "missing")


@pytest.mark.parametrize(
    "change", [{"turns": 0}, {"subagent_probability": 1.5}, {"length_jitter": 1.0}, {"scale": 0}]
)
def test_invalid_configs_name_the_field(change: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(change)).split("_")[0]):
        AgenticConfig(**change)
