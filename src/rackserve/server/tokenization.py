"""Prompt tokenization and chat-template rendering for the API, bounded in size and time.

One request must not freeze or bloat the server, so every prompt passes three checks:

    len(text) chars ──> 1. chars > max_model_len x longest token?  400, nothing tokenized
                    ──> 2. long text: tokenize a prefix cut at a word boundary; more tokens
                           than max_model_len already?  400 (the whole has at least as many)
                    ──> 3. tokenize the whole text (the Rust tokenizer, GIL released)

Check 1 holds for any tokenizer: no token covers more characters than the longest token in
the vocabulary. Check 2 relies on BPE pre-tokenization splitting before a space that
follows a word, so a prefix cut there encodes to a prefix of the full encoding. The
callers run all of this in a worker pool (``TokenizerPool``), so the event loop keeps
serving other clients while a long prompt is encoded, as vLLM's async tokenizer does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rackserve.server.protocol import ParamError

T = TypeVar("T")

# Keys of apply_chat_template itself (and of the render context it builds): inside
# chat_template_kwargs they would collide with the server's own arguments.
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt", "continue_final_message", "conversation", "documents",
        "max_length", "messages", "padding", "return_assistant_tokens_mask", "return_dict",
        "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation",
    }
)  # fmt: skip
# Past this many characters per allowed token a prompt gets the cheap prefix check first.
PREFIX_CHECK_CHARS_PER_TOKEN = 8
DEFAULT_TIMEOUT_S = 30.0


def longest_token_chars(tokenizer: Any) -> int:
    """Most characters one token of ``tokenizer`` can stand for (its longest vocab entry,
    special tokens included; byte-level entries count bytes, which bounds characters)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


def context_error(num_tokens: int, max_model_len: int, what: str, at_least: bool) -> ParamError:
    has = f"at least {num_tokens}" if at_least else str(num_tokens)
    return ParamError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"request has {has} input tokens. Please reduce the length of the input {what}.",
        what,
    )


class BoundedTokenizer:
    """Encodes and renders with the length checks of the module docstring."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = longest_token_chars(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The Rust tokenizer's encode_batch releases the GIL (transformers' encode wraps the
        # same call in Python that holds it); use it when it is configured as encode would.
        plain = backend is not None and backend.truncation is None and backend.padding is None
        self._backend = backend if plain else None

    def max_chars(self, max_model_len: int) -> int:
        return max_model_len * self.max_token_chars

    def check_chars(self, text: str, max_model_len: int, what: str) -> None:
        """Check 1: a text this long cannot fit, whatever its tokens."""
        if len(text) > self.max_chars(max_model_len):
            lower_bound = len(text) // self.max_token_chars
            raise context_error(lower_bound, max_model_len, what, at_least=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is not None:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode(
        self,
        text: str,
        add_special_tokens: bool,
        max_model_len: int,
        what: str = "prompt",
        keep_last: int | None = None,
    ) -> list[int]:
        """Token ids of ``text``; ParamError (a 400) as soon as it cannot fit the context.

        ``keep_last`` (truncate_prompt_tokens): only the last tokens matter, so a long text
        is cut to a tail that surely holds that many, at a pre-token boundary, and only the
        tail is encoded; the caller keeps the last ``keep_last`` ids."""
        if keep_last is not None:
            start = self._tail_cut(text, (keep_last + 1) * self.max_token_chars)
            if start is not None:
                return self._encode(text[start:], False)
        self.check_chars(text, max_model_len, what)
        cut = self._prefix_cut(text, max_model_len * PREFIX_CHECK_CHARS_PER_TOKEN)
        if cut is not None:
            num_prefix_tokens = len(self._encode(text[:cut], False))
            if num_prefix_tokens > max_model_len:
                raise context_error(num_prefix_tokens, max_model_len, what, at_least=True)
        return self._encode(text, add_special_tokens)

    @staticmethod
    def _prefix_cut(text: str, limit: int) -> int | None:
        """An index <= limit just before a space that follows a non-space character (a
        pre-token boundary), or None when the text is short or has no such place."""
        if len(text) <= limit:
            return None
        cut = text.rfind(" ", 1, limit)
        while cut > 0 and text[cut - 1].isspace():
            cut = text.rfind(" ", 1, cut - 1)
        return cut if cut > 0 else None

    @staticmethod
    def _tail_cut(text: str, min_chars: int) -> int | None:
        """An index leaving at least ``min_chars`` after it, just before a space that follows
        a non-space character, or None when there is no such place."""
        if len(text) <= min_chars:
            return None
        cut = text.rfind(" ", 1, len(text) - min_chars + 1)
        while cut > 0 and text[cut - 1].isspace():
            cut = text.rfind(" ", 1, cut - 1)
        return cut if cut > 0 else None

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        max_model_len: int,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The rendered chat, bounded like a prompt (``kwargs`` are already checked by
        ``check_chat_template_kwargs`` where they come from a request)."""
        if not messages:
            raise ParamError("messages must hold at least one message", "messages")
        if not getattr(self.tokenizer, "chat_template", None) and "chat_template" not in kwargs:
            raise ParamError("this model's tokenizer has no chat template", "messages")
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                self.check_chars(content, max_model_len, "messages")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        self.check_chars(text, max_model_len, "messages")
        return text


def check_chat_template_kwargs(kwargs: Mapping[str, Any], trust_request_template: bool) -> None:
    """ParamError for a reserved key, or for a template of the client's own unless the
    operator passed ``--trust-request-chat-template``."""
    if "chat_template" in kwargs and not trust_request_template:
        raise ParamError(
            "chat_template from the request is not allowed on this server (the operator can "
            "allow it with --trust-request-chat-template)",
            "chat_template_kwargs",
        )
    reserved = sorted(RESERVED_CHAT_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ParamError(
            f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it "
            "(use the request parameter of that name where there is one)",
            "chat_template_kwargs",
        )


class TokenizerPool:
    """Runs tokenization work in threads, each call bounded by ``timeout_s``."""

    def __init__(self, num_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        workers = num_workers or min(4, os.cpu_count() or 1)
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, "rackserve-tokenizer")
        self.timeout_s = timeout_s

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, fn, *args)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            # The thread cannot be stopped; it finishes on its own and its result is dropped.
            raise ParamError(
                f"tokenizing the request took longer than {self.timeout_s:g} s; shorten the prompt",
                None,
            ) from None

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
