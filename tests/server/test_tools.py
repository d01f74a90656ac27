"""Tool calls through the openai SDK, streamed and not, with DeepSeek-V4's DSML format; the
engine is a scripted core (tests/server/helpers) that writes a tool-call block."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from rackserve.server.tools import ToolCallParser

from conftest import API_KEY, MODEL_NAME, Server, run_server

HELPERS = Path(__file__).parent / "helpers"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HELPERS), old) if p)
    try:
        with run_server(
            tiny_model, tmp_path_factory.mktemp("tools"), "--api-key", API_KEY,
            "--engine-core-factory", "scripted_core:ScriptedCore",
            "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v4",
            "--max-model-len", "4096", "--max-num-batched-tokens", "4096",
            "--kv-cache-memory-bytes", "256M",
        ) as server:  # fmt: skip
            yield server
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def tool_client(tool_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, max_retries=0)


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_round_trip_not_streamed(tool_client: openai.OpenAI) -> None:
    first = tool_client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, tools=TOOLS)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    check_call(call)
    # the assistant turn as the SDK dumps it, then the tool result, back through the template
    messages = [
        *QUESTION,
        choice.message.model_dump(),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    second = tool_client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls


def test_round_trip_streamed(tool_client: openai.OpenAI) -> None:
    stream = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, stream=True
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice(tool_client: openai.OpenAI, tool_choice) -> None:
    response = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice
    )
    (call,) = response.choices[0].message.tool_calls
    check_call(call)


def test_tool_choice_none_returns_text(tool_client: openai.OpenAI) -> None:
    response = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice="none"
    )
    message = response.choices[0].message
    assert not message.tool_calls and "tool_calls>" in message.content


def test_auto_needs_the_server_flags(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, tools=TOOLS)


# ---- the parser alone --------------------------------------------------------------------

BLOCK = (
    "Sure.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="x" string="false">[1, 2]'
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="b">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)


@pytest.mark.parametrize("step", [1, 3, 7, len(BLOCK)])
def test_parser_streamed_equals_whole(step: int) -> None:
    parser = ToolCallParser()
    content, calls = "", []
    for i in range(0, len(BLOCK), step):
        text, new = parser.feed(BLOCK[i : i + step])
        content += text
        calls += new
    content += parser.finish()
    assert content == "Sure."
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": [1, 2]}, {}]


def test_parser_gives_back_unparsable_blocks_and_plain_text() -> None:
    assert ToolCallParser().parse("no tools <here>\n\n") == ("no tools <here>\n\n", [])
    broken = "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke oops"
    content, calls = ToolCallParser().parse(broken)
    assert calls == [] and content == "x<｜DSML｜tool_calls>\n<｜DSML｜invoke oops"
