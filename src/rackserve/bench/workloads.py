"""Seeded synthetic workloads: coding-agent sessions (``bench agentic``) and random prompts.

An agent session, as the server sees it::

    request t0:  [system][user context][task 0]                            -> reply 0
    request t1:  [system][user context][task 0][reply 0][tool output 1]    -> reply 1
    request t2:  [ ......................... t1 ........][reply 1][tool 2] -> reply 2
    sub-agent:   [ ......... parent context through reply k ....][task]    -> ... (forked)

``system`` is shared by every session; ``user context`` (the per-user salt) is shared only by
sessions of the same user, so users share nothing beyond the system prompt. Each turn sends
the whole previous conversation, including the assistant's actual replies, plus new content.
Sub-agents fork from the parent context after turn ``k``, run their own short session, and
their final replies come back to the parent inside its next tool output.

Lengths are in *approximate tokens*: text is drawn from a fixed vocabulary of common English
words that most BPE tokenizers encode as one token each (with the leading space). Pass a
:class:`TokenCounter` (for example from :func:`load_token_counter`) to size texts exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rackserve.config import ConfigError

# Common words; each is a single token (with its leading space) in GPT-2, Llama-3 and
# DeepSeek vocabularies, which is what makes "one word ~ one token" a fair approximation.
_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her all she there would their we him been has when who
    will more no if out so said what up its about into than them can only other new some
    could time these two may then do first any my now such like our over man me even most
    made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still
    own see men work long get here between both life being under never day same another
    know while last might us great old year off come since against go came right used take
    three file code test line value return error class function data list type name call
    path run build check case table model user server request token cache batch block step
    point read write open close start stop send load save find print count size mode
    """
VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(_WORDS.split()))


class TokenCounter(Protocol):
    """Counts tokens in a text (a tokenizer, or the word approximation)."""

    def count(self, text: str) -> int: ...


@dataclass(frozen=True)
class WordCounter:
    """The default approximation: one whitespace-separated word is one token."""

    def count(self, text: str) -> int:
        return len(text.split())


@dataclass(frozen=True)
class HFTokenCounter:
    """Exact counts from a Hugging Face tokenizer (``tokenizers`` or ``transformers``)."""

    tokenizer: object

    def count(self, text: str) -> int:
        encoded = self.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        return len(encoded.ids if hasattr(encoded, "ids") else encoded)


def load_token_counter(path: str | Path) -> HFTokenCounter:
    """Load ``tokenizer.json`` (fast path, no transformers import) or a HF tokenizer dir."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file() and file.suffix == ".json":
        from tokenizers import Tokenizer

        return HFTokenCounter(Tokenizer.from_file(str(file)))
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer at {path}; pass a HF tokenizer directory")
    from transformers import AutoTokenizer

    return HFTokenCounter(AutoTokenizer.from_pretrained(str(path)))


def make_text(rng: random.Random, num_tokens: int, counter: TokenCounter | None = None) -> str:
    """``num_tokens`` approximate tokens of seeded text; exact-ish when ``counter`` is given."""
    words = rng.choices(VOCABULARY, k=max(1, num_tokens))
    if counter is None:
        return " ".join(words)
    # A word is 1-3 tokens, so adding/dropping the difference converges in a few rounds.
    for _ in range(8):
        error = counter.count(" ".join(words)) - num_tokens
        if error == 0:
            break
        if error > 0:
            words = words[: max(1, len(words) - error)]
        else:
            words += rng.choices(VOCABULARY, k=-error)
    return " ".join(words)


@dataclass(frozen=True)
class AgenticConfig:
    """Shape of synthetic coding-agent sessions. Token lengths are multiplied by ``scale``.

    ``length_jitter`` j draws every length (and the number of turns) uniformly from
    ``[x * (1 - j), x * (1 + j)]``; think time is exponential with mean ``think_time_s``.
    """

    system_prompt_tokens: int = 2048
    user_context_tokens: int = 1024
    first_message_tokens: int = 256
    tool_output_tokens: int = 512
    output_tokens: int = 128
    turns: int = 8
    think_time_s: float = 0.5
    subagent_probability: float = 0.15
    subagent_fanout: int = 2
    subagent_turns: int = 3
    sessions_per_user: int = 1
    length_jitter: float = 0.5
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        lengths = ("system_prompt_tokens", "user_context_tokens", "first_message_tokens")
        for name in (*lengths, "tool_output_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("turns", "subagent_fanout", "subagent_turns", "sessions_per_user"):
            if not 1 <= getattr(self, name) <= 1024:
                raise ConfigError(f"{name} must be in [1, 1024] (got {getattr(self, name)})")
        if not 0.0 <= self.subagent_probability <= 1.0:
            raise ConfigError("subagent_probability must be in [0, 1]")
        if not 0.0 <= self.length_jitter < 1.0:
            raise ConfigError("length_jitter must be in [0, 1)")
        if self.think_time_s < 0 or self.scale <= 0:
            raise ConfigError("think_time_s must be >= 0 and scale > 0")

    def scaled(self, num_tokens: int) -> int:
        return max(1, round(num_tokens * self.scale))


@dataclass(frozen=True)
class Turn:
    """One agent step: new content (task or tool output), reply length, pause before it."""

    content: str
    num_content_tokens: int
    output_tokens: int
    think_time_s: float
    # Forked after this turn's reply; their final replies open the next turn's content.
    subagents: tuple[Session, ...] = ()


@dataclass(frozen=True)
class Session:
    """A top-level agent session (``parent_id is None``) or a sub-agent forked from one."""

    session_id: str
    user_id: int
    system_prompt: str
    user_context: str
    num_system_tokens: int
    num_user_context_tokens: int
    turns: tuple[Turn, ...]
    parent_id: str | None = None


def _jitter(rng: random.Random, value: int, jitter: float) -> int:
    low, high = max(1, round(value * (1 - jitter))), max(1, round(value * (1 + jitter)))
    return rng.randint(low, high)


def _system_prompt(config: AgenticConfig, counter: TokenCounter | None) -> str:
    return make_text(
        random.Random(f"{config.seed}:system"), config.scaled(config.system_prompt_tokens), counter
    )


def _turns(
    config: AgenticConfig,
    rng: random.Random,
    session_id: str,
    user_id: int,
    num_turns: int,
    first_tokens: int,
    counter: TokenCounter | None,
    fork: bool,
) -> tuple[Turn, ...]:
    turns = []
    for k in range(num_turns):
        num_tokens = _jitter(
            rng,
            first_tokens if k == 0 else config.scaled(config.tool_output_tokens),
            config.length_jitter,
        )
        output_tokens = _jitter(rng, config.scaled(config.output_tokens), config.length_jitter)
        think = rng.expovariate(1.0 / config.think_time_s) if k and config.think_time_s else 0.0
        subagents: tuple[Session, ...] = ()
        # Never fork after the last turn: the parent needs a next turn to read the results.
        if fork and k < num_turns - 1 and rng.random() < config.subagent_probability:
            subagents = tuple(
                _subagent(config, rng, f"{session_id}.t{k}.a{i}", session_id, user_id, counter)
                for i in range(config.subagent_fanout)
            )
        content = make_text(rng, num_tokens, counter)
        turns.append(Turn(content, num_tokens, output_tokens, think, subagents))
    return tuple(turns)


def _subagent(
    config: AgenticConfig,
    rng: random.Random,
    session_id: str,
    parent_id: str,
    user_id: int,
    counter: TokenCounter | None,
) -> Session:
    num_turns = _jitter(rng, config.subagent_turns, config.length_jitter)
    first = config.scaled(config.first_message_tokens)
    turns = _turns(config, rng, session_id, user_id, num_turns, first, counter, fork=False)
    return Session(session_id, user_id, "", "", 0, 0, turns, parent_id=parent_id)


def generate_session(
    config: AgenticConfig, index: int, counter: TokenCounter | None = None
) -> Session:
    """Session number ``index`` of the seeded trace (a pure function of config and index)."""
    user_id = index // config.sessions_per_user
    # str seeds hash with SHA-512, so traces are identical across processes and runs.
    user_rng = random.Random(f"{config.seed}:user:{user_id}")
    num_user_tokens = config.scaled(config.user_context_tokens)
    # The explicit id makes users diverge at the first salt token, whatever the random words.
    user_context = f"user {user_id} " + make_text(user_rng, num_user_tokens, counter)
    rng = random.Random(f"{config.seed}:session:{index}")
    session_id = f"s{index}"
    num_turns = _jitter(rng, config.turns, config.length_jitter)
    first = config.scaled(config.first_message_tokens)
    turns = _turns(config, rng, session_id, user_id, num_turns, first, counter, fork=True)
    system = _system_prompt(config, counter)
    return Session(
        session_id,
        user_id,
        system,
        user_context,
        config.scaled(config.system_prompt_tokens),
        num_user_tokens + 2,
        turns,
    )


def iter_sessions(
    config: AgenticConfig, start: int = 0, counter: TokenCounter | None = None
) -> Iterator[Session]:
    """The endless trace from session ``start`` on (closed-loop runs draw as they need)."""
    index = start
    while True:
        yield generate_session(config, index, counter)
        index += 1


Segment = tuple[str, int]  # (key naming a piece of text, its planned number of tokens)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the trace as prefix structure, with replies at their planned length."""

    session_id: str
    turn: int
    prompt: tuple[Segment, ...]
    output: Segment


def plan_requests(session: Session, parent_context: Sequence[Segment] = ()) -> list[PlannedRequest]:
    """Requests of ``session`` and its sub-agents in the order an agent issues them.

    Mirrors how :mod:`rackserve.bench.agentic` builds messages: turn 0 sends
    ``[system][user context][task]``, turn k appends the previous reply, then any sub-agent
    results and the new tool output; a sub-agent starts from the parent context at the fork.
    """
    sid = session.session_id
    if session.parent_id is None:
        context = [("system", session.num_system_tokens)]
        context.append((f"user:{session.user_id}", session.num_user_context_tokens))
    else:
        context = list(parent_context)
    planned: list[PlannedRequest] = []
    subagent_results: list[Segment] = []
    for k, turn in enumerate(session.turns):
        context += subagent_results
        context.append((f"{sid}.t{k}.in", turn.num_content_tokens))
        reply = (f"{sid}.t{k}.out", turn.output_tokens)
        planned.append(PlannedRequest(sid, k, tuple(context), reply))
        context.append(reply)
        subagent_results = []
        for subagent in turn.subagents:
            sub_requests = plan_requests(subagent, context)
            planned += sub_requests
            subagent_results.append(sub_requests[-1].output)
    return planned
