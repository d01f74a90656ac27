"""Tool calls: DeepSeek-V4's DSML tool-call block parsed into OpenAI ``tool_calls``.

The model writes calls after its text (the chat template renders earlier calls the same way):

    Let me check.\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` values are raw text, the others JSON. One ``ToolCallParser`` per choice
takes the text as it streams: text before the block is content (a possible start of the
block is held back), each complete ``invoke`` becomes one tool call. A block that never
yields a call is given back as content, as vLLM's parsers do with unparsable output.
Parsers are registered by name (``--tool-call-parser``).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from rackserve.model.tokenizer import DSML, INVOKE_END, TOOL_CALLS_BEGIN

# The separator the template puts between content and the block (not part of the content).
_SEPARATOR = "\n\n"
_INVOKE = re.compile(
    rf'<{DSML}invoke name="(?P<name>[^"]*)">\n?(?P<body>.*?)\n?{re.escape(INVOKE_END)}', re.S
)
_PARAMETER = re.compile(
    rf'<{DSML}parameter name="(?P<name>[^"]*)" string="(?P<string>true|false)">'
    rf"(?P<value>.*?)</{DSML}parameter>",
    re.S,
)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def parse_invoke(name: str, body: str) -> dict:
    """One call as OpenAI's ``{id, type, function: {name, arguments}}`` (arguments JSON)."""
    arguments: dict[str, Any] = {}
    for match in _PARAMETER.finditer(body):
        value: Any = match["value"]
        if match["string"] == "false":
            # a malformed value stays text: it is still the model's answer
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(value)
        arguments[match["name"]] = value
    return {
        "id": tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _held_back(text: str) -> int:
    """How many trailing characters of ``text`` could start ``\\n\\n<｜DSML｜tool_calls>``."""
    marker = _SEPARATOR + TOOL_CALLS_BEGIN
    for k in range(min(len(marker), len(text)), 0, -1):
        if marker.startswith(text[-k:]) or TOOL_CALLS_BEGIN.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolCallParser:
    """DeepSeek-V4 (DSML) tool calls from streamed text; ``feed`` deltas, then ``finish``."""

    buffer: str = ""  # text not yet given out
    in_block: bool = False
    block_text: str = ""  # everything from the block marker on (returned if no call parses)
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send now, tool calls completed by this delta)."""
        self.buffer += delta
        content = ""
        if not self.in_block:
            start = self.buffer.find(TOOL_CALLS_BEGIN)
            if start < 0:
                keep = _held_back(self.buffer)
                content = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(content) :]
                return content, []
            content = self.buffer[:start]
            content = content.removesuffix(_SEPARATOR)
            self.in_block = True
            self.buffer = self.buffer[start + len(TOOL_CALLS_BEGIN) :]
            self.block_text = TOOL_CALLS_BEGIN
        new_calls = []
        while (match := _INVOKE.search(self.buffer)) is not None:
            new_calls.append(parse_invoke(match["name"], match["body"]))
            self.block_text += self.buffer[: match.end()]
            self.buffer = self.buffer[match.end() :]
        self.calls += new_calls
        return content, new_calls

    def finish(self) -> str:
        """The content still held back at the end of the text."""
        rest, self.buffer = self.buffer, ""
        if not self.in_block:
            return rest
        if not self.calls:  # a block that never produced a call: the text is the answer
            return self.block_text + rest
        return ""

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """The whole text at once: (content, tool calls)."""
        content, calls = self.feed(text)
        return content + self.finish(), calls


TOOL_PARSERS = {"deepseek_v4": ToolCallParser}


def forced_prefix(tool_choice: str | dict | None) -> str:
    """The start of the block appended to the prompt when a call is required ("required",
    or a named function), so the model continues with a call."""
    if tool_choice == "required":
        return f"{_SEPARATOR}{TOOL_CALLS_BEGIN}\n"
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return f'{_SEPARATOR}{TOOL_CALLS_BEGIN}\n<{DSML}invoke name="{name}">\n'
    return ""


def template_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` for the template: arguments as a mapping, not a JSON
    string (the template renders each argument as a DSML parameter)."""
    out = []
    for call in tool_calls:
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            function["arguments"] = parsed if isinstance(parsed, dict) else arguments
        out.append({**call, "function": function})
    return out
