"""An engine core that replies with scripted text (token by token), for tool-call tests:
the tiny random model never writes a tool-call block, a test client needs one.

Used as ``rackserve serve --engine-core-factory scripted_core:ScriptedCore`` with this
folder on PYTHONPATH. The reply depends on how the prompt ends (see ``reply_for``)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from rackserve.config import EngineConfig
from rackserve.engine.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from rackserve.model.tokenizer import (
    DSML,
    EOS_TOKEN_ID,
    INVOKE_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_OUTPUT_END_TOKEN,
)

CALL_BODY = (
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
    f"{INVOKE_END}"
)
INVOKE = f'<{DSML}invoke name="get_weather">\n{CALL_BODY}'
ANSWER = "It is sunny in Paris."


def reply_for(prompt: str) -> str:
    if prompt.endswith(f'<{DSML}invoke name="get_weather">\n'):  # tool_choice named
        return f"{CALL_BODY}\n{TOOL_CALLS_END}"
    if prompt.endswith(f"{TOOL_CALLS_BEGIN}\n"):  # tool_choice "required"
        return f"{INVOKE}\n{TOOL_CALLS_END}"
    if prompt.rstrip().endswith(TOOL_OUTPUT_END_TOKEN + "<｜Assistant｜>"):
        return ANSWER
    if "## Tools" in prompt:
        return f"Let me check.\n\n{TOOL_CALLS_BEGIN}\n{INVOKE}\n{TOOL_CALLS_END}"
    return "Hello there."


class ScriptedCore:
    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = Tokenizer.from_file(str(Path(config.model) / "tokenizer.json"))
        self.eos_token_ids = (EOS_TOKEN_ID,)
        self.max_model_len = config.scheduler.max_model_len
        self.pending: dict[str, list[int]] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        ids = self.tokenizer.encode(reply_for(prompt), add_special_tokens=False).ids
        self.pending[request.request_id] = [*ids, EOS_TOKEN_ID]

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.pending.pop(request_id, None)

    def step(self) -> EngineCoreOutputs:
        outputs = []
        for request_id, ids in list(self.pending.items()):
            token = ids.pop(0)
            done = not ids
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [token],
                    finish_reason="stop" if done else None,
                    stop_reason=None,
                )
            )
            if done:
                del self.pending[request_id]
        return EngineCoreOutputs(outputs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def shutdown(self) -> None:
        pass
