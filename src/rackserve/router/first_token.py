"""A streamed P/D request's first token, sent to the client from the prefill engine's answer.

The prefill engine runs the whole prompt and samples the first token t1. Streamed, its
answer to ``do_remote_decode`` is what an aggregated engine would stream first (the chat
role, then t1's chunk: its text and logprobs), then a last event with the transfer
parameters (server/responder.py ``stream``). The router sends those chunks on as soon as they
arrive, so the client's TTFT is the prefill engine's plus one hop, not that plus the decode
request's hop. The decode engine, handed t1 in the parameters, streams the request from the
start: it emits t1 on arrival, so its stream begins with the same chunks, which
``DecodeFilter`` drops.

The two streams' first chunks are the same by construction only where nothing rewrites the
text of the first token after it was sampled, hence ``eligible``: one prompt and n = 1 (the
prefill engine carries t1 for one completion), no stop strings (an aggregated engine holds
back text that may begin one; the prefill engine, finished at its one token, would send
it), no tool parsing (its finish flushes the block), and no request for the decode side
alone (echo, prompt logprobs). The prefill chunk's finish_reason (its forced one-token
limit) is cleared. When t1 ends the request, the decode side's chunk for t1 carries the real
reason: it goes on with its text and logprobs emptied, as they were sent already.
"""

from __future__ import annotations

from typing import Any

import msgspec

DONE = b"data: [DONE]"


def eligible(body: dict[str, Any], chat: bool) -> bool:
    """Whether the first token of this request may come from the prefill engine's stream
    (module docstring)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return False
    if body.get("best_of") not in (None, 1) or body.get("echo") or body.get("stop"):
        return False
    if body.get("prompt_logprobs") is not None:
        return False
    if chat:
        return not body.get("tools") or body.get("tool_choice") == "none"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
    )


class SSEEvents:
    """Splits a byte stream into server-sent events (``data: ...`` without the blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [e for e in events if e]

    def rest(self) -> bytes:
        """What came after the last complete event."""
        rest, self._buffer = self._buffer, b""
        return rest


def parse(event: bytes) -> Any:
    """An event's JSON payload, or None ([DONE], comments, not JSON)."""
    if not event.startswith(b"data: ") or event == DONE:
        return None
    try:
        return msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        return None


def encode(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _is_role(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta


def _says_something(choice: dict[str, Any], chat: bool) -> bool:
    """Whether an aggregated engine would send t1's chunk while the request runs on: text
    or logprobs (server/responder.py skips a chunk with neither)."""
    if choice.get("logprobs") is not None:
        return True
    if chat:
        delta = choice.get("delta")
        return isinstance(delta, dict) and bool(delta.get("content"))
    return bool(choice.get("text"))


class PrefillStream:
    """Reads the prefill engine's streamed answer: ``first`` (the chunks to send the client
    now, once t1's arrived; None while it has not, or if t1 says nothing yet) and
    ``params`` (the last event's kv_transfer_params)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.events = SSEEvents()
        self.held: list[bytes] = []  # the role chunk, sent with t1's
        self.first: bytes | None = None
        self.seen_first = False
        self.params: dict[str, Any] | None = None

    def feed(self, data: bytes) -> bytes | None:
        """New bytes of the answer; the chunks to send on now (once), else None."""
        ready = None
        for event in self.events.feed(data):
            payload = parse(event)
            if not isinstance(payload, dict):
                continue
            if isinstance(payload.get("kv_transfer_params"), dict):
                self.params = payload["kv_transfer_params"]
                continue
            choices = payload.get("choices")
            if self.seen_first or not isinstance(choices, list) or len(choices) != 1:
                continue  # the usage chunk, or a shape this protocol does not know
            choice = choices[0]
            if not isinstance(choice, dict):
                continue
            if self.chat and _is_role(choice):
                self.held.append(event + b"\n\n")
                continue
            self.seen_first = True
            if _says_something(choice, self.chat):
                choice.update(finish_reason=None, stop_reason=None)
                ready = self.first = b"".join(self.held) + encode(payload)
        return ready


class DecodeFilter:
    """The decode engine's stream less what the client has from the prefill engine: the
    role chunk and t1's chunk (its finish_reason kept when t1 ended the request)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.events = SSEEvents()
        self.dropping = True

    def feed(self, data: bytes) -> bytes:
        if not self.dropping:
            return data
        out = []
        for event in self.events.feed(data):
            if not self.dropping:
                out.append(event + b"\n\n")
                continue
            payload = parse(event)
            choices = payload.get("choices") if isinstance(payload, dict) else None
            if not isinstance(choices, list) or len(choices) != 1:
                self.dropping = False  # an error event, or another shape: send it all on
                out.append(event + b"\n\n")
                continue
            choice = choices[0]
            if self.chat and isinstance(choice, dict) and _is_role(choice):
                continue
            self.dropping = False  # t1's chunk: sent already
            if isinstance(choice, dict) and choice.get("finish_reason") is not None:
                choice["logprobs"] = None
                if self.chat:
                    choice["delta"] = {}
                else:
                    choice["text"] = ""
                out.append(encode(payload))
        if not self.dropping:
            out.append(self.events.rest())
        return b"".join(out)
