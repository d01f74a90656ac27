"""Bounded tokenization: the fast path gives transformers' ids, the length checks reject
without tokenizing the whole text, and request-supplied templates are refused by default."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rackserve.model.tokenizer import USER_TOKEN, write_tokenizer
from rackserve.server.protocol import ParamError
from rackserve.server.tokenization import (
    BoundedTokenizer,
    TokenizerPool,
    check_chat_template_kwargs,
)

MAX_MODEL_LEN = 512
TEXTS = [
    "hello world",
    "  leading spaces and\n\nnewlines\t tabs",
    f"{USER_TOKEN}special in the middle{USER_TOKEN}",
    "unicode: héllo wörld — ✓ 日本語",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    out: Path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(out, 1024)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def bounded(hf_tokenizer) -> BoundedTokenizer:
    return BoundedTokenizer(hf_tokenizer)


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(hf_tokenizer, bounded: BoundedTokenizer, add_special: bool):
    assert bounded._backend is not None  # the GIL-free path is the one under test
    for text in TEXTS:
        expected = hf_tokenizer.encode(text, add_special_tokens=add_special)
        assert bounded.encode(text, add_special, MAX_MODEL_LEN) == expected


def test_prefix_cut_is_a_token_prefix(hf_tokenizer, bounded: BoundedTokenizer):
    text = "the cat sat on  the mat, and then   it left.\n " * 40
    for limit in (7, 50, 333, 1000):
        cut = bounded._prefix_cut(text, limit)
        assert cut is not None and cut <= limit and text[cut] == " "
        full = hf_tokenizer.encode(text, add_special_tokens=False)
        prefix = hf_tokenizer.encode(text[:cut], add_special_tokens=False)
        assert full[: len(prefix)] == prefix


def test_tail_cut_keeps_the_last_tokens(hf_tokenizer, bounded: BoundedTokenizer):
    text = " ".join(f"word{i}" for i in range(3000))
    full = hf_tokenizer.encode(text, add_special_tokens=True)
    for keep in (1, 17, 200):
        ids = bounded.encode(text, True, MAX_MODEL_LEN, keep_last=keep)
        assert len(ids) < len(full) and ids[-keep:] == full[-keep:]


def test_overlong_text_rejected_before_tokenizing(bounded: BoundedTokenizer, monkeypatch):
    calls: list[int] = []
    original = bounded._encode
    monkeypatch.setattr(bounded, "_encode", lambda t, s: calls.append(len(t)) or original(t, s))
    huge = "x" * (bounded.max_chars(MAX_MODEL_LEN) + 1)
    with pytest.raises(ParamError, match="at least"):
        bounded.encode(huge, True, MAX_MODEL_LEN)
    assert calls == []  # check 1: nothing tokenized
    words = "hello " * (bounded.max_chars(MAX_MODEL_LEN) // 7)
    with pytest.raises(ParamError, match="at least") as info:
        bounded.encode(words, True, MAX_MODEL_LEN)
    assert info.value.param == "prompt"
    assert calls and max(calls) <= MAX_MODEL_LEN * 8  # check 2: only a prefix tokenized


def test_chat_template_kwargs_checks(bounded: BoundedTokenizer):
    check_chat_template_kwargs({"enable_thinking": True}, False)
    for key in ("tokenize", "conversation", "add_generation_prompt", "tools"):
        with pytest.raises(ParamError, match=key) as info:
            check_chat_template_kwargs({key: 1}, False)
        assert info.value.param == "chat_template_kwargs"
    with pytest.raises(ParamError, match="--trust-request-chat-template"):
        check_chat_template_kwargs({"chat_template": "{{ 'x' * 10 }}"}, False)
    check_chat_template_kwargs({"chat_template": "{{ 'x' }}"}, True)
    messages = [{"role": "user", "content": "hi"}]
    text = bounded.render_chat(messages, True, MAX_MODEL_LEN, {"chat_template": "T{{ 7 }}"})
    assert text == "T7"
    with pytest.raises(ParamError, match="at least"):  # the output is bounded too
        bounded.render_chat(messages, True, MAX_MODEL_LEN, {"chat_template": "{{ 'y' * 10**6 }}"})


def test_pool_keeps_the_loop_responsive_and_bounds_time():
    async def scenario() -> tuple[float, str]:
        pool = TokenizerPool(num_workers=2, timeout_s=0.3)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        start = time.monotonic()
        with pytest.raises(ParamError, match=r"longer than 0\.3 s"):
            await pool.run(time.sleep, 1.0)
        elapsed = time.monotonic() - start
        ticker.cancel()
        assert ticks >= 10  # the loop kept running while the worker was busy
        result = await asyncio.wait_for(pool.run(str.upper, "ok"), 5)
        pool.shutdown()
        return elapsed, result

    elapsed, result = asyncio.run(scenario())
    assert elapsed < 0.9 and result == "OK"
