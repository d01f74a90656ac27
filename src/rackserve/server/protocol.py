"""OpenAI request models (pydantic) and the response shapes, with vLLM's extra parameters.

Validation is lenient as vLLM's: an explicit ``null`` means the field's default, and an
unknown field (``store``, ``metadata``, ``service_tier``, ...; also ``refusal`` or ``audio``
in an assistant message from ``message.model_dump()``) is accepted and ignored; the API
logs every ignored field (``ignored_fields``). A value that is wrong, or a known parameter
at a value we do not honour (``best_of``, ``suffix``, ...), is a 400 naming the parameter.

Responses are built as plain dicts (``*_response``/``*_chunk`` helpers) in the exact
layout OpenAI and vLLM send; streaming encodes them with msgspec, which is fast enough
for many concurrent streams on one core.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rackserve.engine.request_output import TokenLogprob
from rackserve.request import (
    INT64_MAX,
    INT64_MIN,
    MAX_NUM_LOGPROBS,
    KVTransferParams,
    SamplingParams,
    StructuredOutputsParams,
)
from rackserve.server.tools import template_tool_calls

# Integers the engine holds as int64 (seeds, top_k, priorities): a larger value is a 400
# here, not an overflow in the engine or in msgspec (vLLM bounds seed the same way).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class ParamError(ValueError):
    """A request parameter is invalid or unsupported; ``param`` names it."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # set for a server limit, so rejections can be counted by reason


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients serialise unset optionals as null (pydantic's model_dump, many SDKs).
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the unknown fields here and in nested models (for the log)."""
        names = [prefix + name for name in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, OpenAIModel):
                names += value.ignored_fields(f"{prefix}{name}.")
            elif isinstance(value, list) and value and isinstance(value[0], OpenAIModel):
                # lists of models (messages, content parts); not a prompt's token ids, which
                # a walk item by item took 3 ms for at 16K tokens
                for i, item in enumerate(value):
                    if isinstance(item, OpenAIModel):
                        names += item.ignored_fields(f"{prefix}{name}.{i}.")
        return names


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # BaseModel has .schema
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: str  # text, json_object, json_schema (checked where it is read, param named)
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` (exactly one constraint; see StructuredOutputsParams)."""

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")  # BaseModel has .json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    # strict schemas (no properties beyond those listed) are what we always compile
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # one library, no fallback to disable
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Int64 | None = None
    user: str | None = None  # an end-user id; it does not change the output
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    priority: Int64 = 0
    cache_salt: str | None = None
    request_id: str | None = None
    # P/D disaggregation handshake, as vLLM's disaggregated proxy sends it (disagg/)
    kv_transfer_params: dict[str, Any] | None = None
    # structured output (runner/structured_output.py): OpenAI's, vLLM's, vLLM's legacy
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field that gave it; ParamError (naming
        the field) when two fields give one, or a value cannot be honoured."""
        sources: list[tuple[str, Callable[[], StructuredOutputsParams]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            sources.append(("response_format", lambda: self._response_format_params(fmt)))
        if self.structured_outputs is not None:
            sources.append(("structured_outputs", self._structured_outputs_field_params))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                build = functools.partial(StructuredOutputsParams, **{kind: value})
                sources.append((f"guided_{kind}", build))
        if not sources:
            return None, None
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise ParamError(f"give only one output constraint; got {names}", sources[1][0])
        name, build = sources[0]
        try:
            return build(), name
        except ParamError:
            raise
        except ValueError as e:
            raise ParamError(str(e), name) from None

    def _structured_outputs_field_params(self) -> StructuredOutputsParams:
        so = self.structured_outputs
        assert so is not None
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(so, name) is not None:
                raise ParamError(
                    f"structured_outputs.{name} is not supported", "structured_outputs"
                )
        return StructuredOutputsParams(
            json=so.json_schema,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=so.json_object,
            disable_any_whitespace=so.disable_any_whitespace,
        )

    @staticmethod
    def _response_format_params(fmt: ResponseFormat) -> StructuredOutputsParams:
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.type != "json_schema":
            raise ParamError(
                f"response_format type must be text, json_object or json_schema, got {fmt.type!r}",
                "response_format",
            )
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ParamError(
                'response_format {"type": "json_schema"} needs json_schema.schema',
                "response_format",
            )
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with token-id keys; ParamError for a key that is not a number."""
        if not self.logit_bias:
            return None
        try:
            return {int(token_id): value for token_id, value in self.logit_bias.items()}
        except ValueError:
            raise ParamError("logit_bias keys must be token ids (integers)", "logit_bias") from None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; raises ParamError naming a bad value."""
        structured_outputs, _ = self.structured_outputs_params()
        try:
            kv_transfer_params = (
                None
                if self.kv_transfer_params is None
                else KVTransferParams.from_dict(self.kv_transfer_params)
            )
        except ValueError as e:
            raise ParamError(str(e), "kv_transfer_params") from None
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=1.0
                if self.repetition_penalty is None
                else self.repetition_penalty,
                stop=[] if self.stop is None else self.stop,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self.token_logit_bias(),
                structured_outputs=structured_outputs,
                kv_transfer_params=kv_transfer_params,
            )
        except ValueError as e:
            message = str(e)
            raise ParamError(message, message.split(" ", 1)[0]) from None

    def check_logit_bias(self, vocab_size: int) -> None:
        for token_id in self.token_logit_bias() or {}:
            if not 0 <= token_id < vocab_size:
                raise ParamError(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                    "logit_bias",
                )


class CompletionRequest(SamplingRequest):
    # list[int] before list[str]: pydantic's smart union then validates a token-id prompt
    # 8x faster (16K ids: 3.6 -> 0.46 ms, paid on every hop of a P/D request)
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0: score the prompt only (echo + logprobs), as lm-eval's loglikelihood requests do
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_NUM_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of other than n is not supported", "best_of")
        if self.suffix:
            raise ParamError("suffix is not supported", "suffix")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ParamError("prompt must not be empty", "prompt")


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_NUM_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        self.check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError(
                "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt to false",
                "continue_final_message",
            )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check_tools(self) -> None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return
        if not self.tools:
            raise ParamError("tool_choice other than 'none' or 'auto' needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools}
            if choice.function.name not in names:
                raise ParamError(
                    f"tool_choice names the function {choice.function.name!r}, which is "
                    "not among the tools",
                    "tool_choice",
                )

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template; ``developer`` is the newer name of ``system``."""
        out = []
        for m in self.messages:
            message = m.model_dump(exclude_none=True)
            if message["role"] == "developer":
                message["role"] = "system"
            if message.get("tool_calls"):
                message["tool_calls"] = template_tool_calls(message["tool_calls"])
            out.append(message)
        return out


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def chat_logprobs(entries: list[TokenLogprob], num_top: int) -> dict:
    """``choice.logprobs`` of a chat completion: one item per generated token."""

    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **item(e.token, e.logprob),
                "top_logprobs": [item(text, lp) for _, text, lp in e.top[:num_top]],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprob] | list[TokenLogprob | str], num_top: int, text_offset: int
) -> dict:
    """``choice.logprobs`` of a completion; the sampled token is in ``top_logprobs`` too.

    A ``str`` entry is a token without a logprob (the first prompt token when ``echo``
    scores the prompt): its logprob and top logprobs are null, as in OpenAI and vLLM."""
    offsets, offset = [], text_offset
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict | None] = []
    for e in entries:
        offsets.append(offset)
        if isinstance(e, str):
            tokens.append(e)
            token_logprobs.append(None)
            top_logprobs.append(None)
            offset += len(e)
            continue
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top = {e.token: e.logprob}
        if num_top:
            top.update({text: lp for _, text, lp in e.top[:num_top]})
        top_logprobs.append(top)
        offset += len(e.token)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def prompt_logprobs_json(entries: list[TokenLogprob | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position, {token id: {logprob, rank, token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token},
            **{
                str(t): {"logprob": lp, "rank": None, "decoded_token": text}
                for t, text, lp in e.top
                if t != e.token_id
            },
        }
        for e in entries
    ]


def now_s() -> int:
    return int(time.time())
