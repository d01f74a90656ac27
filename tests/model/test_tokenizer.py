"""The embedded tokenizer: ids, determinism, transformers loading and the chat round trip."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rackserve.model.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_tokenizer,
)

VOCAB_SIZE = 4096


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    start = time.perf_counter()
    write_tokenizer(out, VOCAB_SIZE)
    assert time.perf_counter() - start < 10, "training must stay fast"
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_files_and_special_token_ids(tokenizer_dir: Path, hf_tokenizer):
    names = {p.name for p in tokenizer_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert len(hf_tokenizer) == VOCAB_SIZE
    assert hf_tokenizer.bos_token_id == BOS_TOKEN_ID == 0
    assert hf_tokenizer.eos_token_id == EOS_TOKEN_ID == 1
    ids = hf_tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(len(SPECIAL_TOKENS)))
    assert hf_tokenizer.pad_token == SPECIAL_TOKENS[-1]
    assert hf_tokenizer.chat_template == (tokenizer_dir / "chat_template.jinja").read_text()


def test_plain_text_round_trips_and_gets_bos(hf_tokenizer):
    text = "The harbour was quiet.\n    def f(x):\n        return x * 2  # ünïcödé ✓"
    ids = hf_tokenizer(text).input_ids
    assert ids[0] == BOS_TOKEN_ID and BOS_TOKEN_ID not in ids[1:]
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    # Trained merges actually compress common English.
    assert len(hf_tokenizer("the morning", add_special_tokens=False).input_ids) <= 3


def test_write_is_deterministic_across_processes(tokenizer_dir: Path, tmp_path: Path):
    script = (
        "import sys; from pathlib import Path; "
        "from rackserve.model.tokenizer import write_tokenizer; "
        f"write_tokenizer(Path(sys.argv[1]), {VOCAB_SIZE})"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name


@pytest.mark.parametrize("vocab_size", [300, 1000, 20000])
def test_vocab_size_is_exact(vocab_size: int):
    tokenizer = build_tokenizer(vocab_size)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    assert max(tokenizer.get_vocab().values()) == vocab_size - 1


def test_too_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="at least 263"):
        build_tokenizer(100)


def test_chat_template_renders_deepseek_style(hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": '{"ok": true}'},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        '<｜tool▁output▁begin｜>{"ok": true}<｜tool▁output▁end｜><｜User｜>Thanks<｜Assistant｜>'
    )


# Replies and follow-ups chosen so that, without a special token at each boundary, BPE would
# merge across it: trailing spaces and newlines, leading spaces, punctuation, code.
CONVERSATION = [
    ("user", "Tell me about the harbour."),
    ("The harbour was quiet that morning. ", "user", " and then?"),
    ("def f(x):\n    return x\n\n", "tool", "\n\nresult: 42"),
    ("  The tide turned", "user", "ing? Explain, please"),
    ("ok", "user", "!"),
]


def test_chat_template_round_trip_preserves_token_prefix(hf_tokenizer):
    """Turn k+1's prompt ids == turn k's prompt ids + reply ids + EOS + ... (prefix caching)."""

    def encode(text: str) -> list[int]:
        return hf_tokenizer(text, add_special_tokens=False).input_ids

    def render(messages: list[dict]) -> list[int]:
        text = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return encode(text)

    messages = [{"role": "system", "content": "You are a careful assistant."}]
    role, content = CONVERSATION[0]
    messages.append({"role": role, "content": content})
    prompt_ids = render(messages)
    for reply, next_role, next_content in CONVERSATION[1:]:
        reply_ids = encode(reply)  # what the model "generated", then closed with EOS
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": next_role, "content": next_content})
        next_prompt_ids = render(messages)
        expected_prefix = [*prompt_ids, *reply_ids, EOS_TOKEN_ID]
        assert next_prompt_ids[: len(expected_prefix)] == expected_prefix, reply
        prompt_ids = next_prompt_ids
