"""router/first_token.py: which requests take their first token from the prefill engine's
stream, and the two stream edits (the prefill answer's first chunks, the decode stream less
them), fed at every byte boundary."""

from __future__ import annotations

import json

import pytest

from rackserve.router.first_token import DecodeFilter, PrefillStream, eligible


def event(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


HEAD = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
CHAT = dict(HEAD, id="chatcmpl-x", object="chat.completion.chunk")


def completion(text, finish=None, logprobs=None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
              "stop_reason": None}  # fmt: skip
    return event(dict(HEAD, choices=[choice]))


def chat(delta, finish=None, logprobs=None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return event(dict(CHAT, choices=[choice]))


ROLE = chat({"role": "assistant", "content": ""})
DONE = b"data: [DONE]\n\n"
PARAMS = {"do_remote_prefill": True, "transfer_id": "t", "first_token_ids": [5]}


def pieces(data: bytes, cut: int) -> list[bytes]:
    return [data[:cut], data[cut:]]


@pytest.mark.parametrize(
    ("body", "chat_path", "want"),
    [
        ({"stream": True, "prompt": "hi"}, False, True),
        ({"stream": True, "prompt": [1, 2, 3]}, False, True),
        ({"stream": True, "prompt": ["one"]}, False, True),
        ({"stream": True, "prompt": ["one", "two"]}, False, False),  # two prompts
        ({"stream": True, "prompt": [[1, 2], [3]]}, False, False),
        ({"prompt": "hi"}, False, False),  # not streamed
        ({"stream": True, "prompt": "hi", "n": 2}, False, False),
        ({"stream": True, "prompt": "hi", "stop": ["x"]}, False, False),  # held-back text
        ({"stream": True, "prompt": "hi", "stop": []}, False, True),
        ({"stream": True, "prompt": "hi", "echo": True}, False, False),
        ({"stream": True, "prompt": "hi", "prompt_logprobs": 0}, False, False),
        ({"stream": True, "messages": []}, True, True),
        ({"stream": True, "messages": [], "tools": [{"type": "function"}]}, True, False),
        ({"stream": True, "messages": [], "tools": [{}], "tool_choice": "none"}, True, True),
    ],
)
def test_eligible(body, chat_path, want):
    assert eligible(body, chat_path) is want


@pytest.mark.parametrize("is_chat", [False, True])
def test_prefill_stream_gives_the_first_chunks_once(is_chat):
    first = (
        chat({"content": "He"}, "length", {"content": []})
        if is_chat
        else completion("He", "length", {"tokens": ["He"]})
    )
    usage = event(dict(HEAD, choices=[], usage={"prompt_tokens": 3}))
    kv = event(dict(HEAD, choices=[], kv_transfer_params=PARAMS))
    answer = (ROLE if is_chat else b"") + first + usage + kv + DONE
    for cut in range(len(answer) + 1):
        reader = PrefillStream(is_chat)
        sent = [r for r in (reader.feed(p) for p in pieces(answer, cut)) if r is not None]
        assert len(sent) == 1 and reader.first == sent[0]
        assert reader.params == PARAMS
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in sent[0].split(b"\n\n") if e]
        assert len(chunks) == (2 if is_chat else 1)
        assert chunks[-1]["choices"][0]["finish_reason"] is None  # the forced one-token stop
        if is_chat:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[1]["choices"][0]["delta"] == {"content": "He"}
        else:
            assert chunks[0]["choices"][0]["text"] == "He"


def test_prefill_stream_sends_nothing_for_a_silent_first_token():
    """t1 without text (a partial character) and without logprobs: an aggregated engine
    sends no chunk for it, so the decode side's stream goes to the client whole."""
    kv = event(dict(CHAT, choices=[], kv_transfer_params=PARAMS))
    answer = ROLE + chat({"content": ""}, "length") + kv
    reader = PrefillStream(True)
    assert reader.feed(answer) is None and reader.first is None
    assert reader.params == PARAMS


def test_decode_filter_drops_what_the_client_has():
    rest = completion(" there") + completion("!", "length") + DONE
    stream = completion("He", logprobs={"tokens": ["He"]}) + rest
    for cut in range(len(stream) + 1):
        keep = DecodeFilter(False)
        assert b"".join(keep.feed(p) for p in pieces(stream, cut)) == rest
    chat_rest = chat({"content": " there"}, "stop") + DONE
    stream = ROLE + chat({"content": "He"}) + chat_rest
    for cut in range(len(stream) + 1):
        keep = DecodeFilter(True)
        assert b"".join(keep.feed(p) for p in pieces(stream, cut)) == chat_rest


@pytest.mark.parametrize("is_chat", [False, True])
def test_decode_filter_keeps_the_reason_of_a_final_first_token(is_chat):
    """t1 ended the request (max_tokens 1, a stop token): its reason goes on, its text and
    logprobs (sent already) do not."""
    if is_chat:
        stream = ROLE + chat({"content": "He"}, "length", {"content": [1]}) + DONE
    else:
        stream = completion("He", "length", {"tokens": ["He"]}) + DONE
    out = DecodeFilter(is_chat).feed(stream)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 2
    choice = json.loads(events[0].removeprefix(b"data: "))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert (choice["delta"] == {}) if is_chat else (choice["text"] == "")


def test_decode_filter_passes_an_error_event_on():
    error = event({"error": {"message": "boom", "type": "InternalServerError"}})
    assert DecodeFilter(False).feed(error + DONE) == error + DONE
