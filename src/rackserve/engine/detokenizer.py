"""Incremental detokenization for the frontend (vLLM's prefix/read-offset scheme)."""

from __future__ import annotations

from typing import Any

# Prompt tokens the detokenizer starts from, so the first generated token is decoded in
# context (a leading space or a multi-byte character split across the prompt boundary).
_PROMPT_CONTEXT_TOKENS = 6


class Detokenizer:
    """Incremental detokenization with prefix/read offsets (vLLM's scheme).

    ``tokens[prefix_offset:read_offset]`` is already-emitted context; decoding it with the
    new tokens and cutting off its own decoding gives the new text. A result ending in
    U+FFFD is an incomplete UTF-8 sequence, so nothing is emitted until it completes.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        special_ids: frozenset[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = special_ids
        self.tokens = self._to_tokens(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT_TOKENS + 1, 0)
        self.text = ""

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        if self.skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_ids]
        # ids the tokenizer has no token for (the model's vocabulary padded past the
        # tokenizer's, as DeepSeek's is; random checkpoints emit them) decode as nothing
        return [t or "" for t in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it completed (possibly empty)."""
        self.tokens.extend(self._to_tokens([token_id]))
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(self.tokens[self.prefix_offset : self.read_offset])
        new_text = convert(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``skip_special_tokens`` removes: the named specials and added special tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return frozenset(ids)
