"""What the OpenAI endpoints do between parsing and the engine: tokenize (chat template),
check limits and lengths, set up scoring (echo + logprobs) and tool calls, and hand a
``Prepared`` request to ``responder.py``; and the small endpoints (models, tokenize,
detokenize).

One client request may hold several prompts (``/v1/completions`` accepts a list); each is
one engine request (``n`` completions).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rackserve.request import MAX_NUM_LOGPROBS, SamplingParams
from rackserve.runner.structured_output import check_structured_outputs
from rackserve.server.async_client import AsyncEngineClient
from rackserve.server.limits import RequestLimits
from rackserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ParamError,
    TokenizeRequest,
)
from rackserve.server.responses import now_s
from rackserve.server.tokenization import BoundedTokenizer, check_chat_template_kwargs
from rackserve.server.tools import TOOL_PARSERS, ToolCallParser, forced_prefix


@dataclass
class Prepared:
    """A validated, tokenized request, ready for the engine."""

    chat: bool
    body: ChatCompletionRequest | CompletionRequest
    response_id: str
    model: str
    prompts: list[tuple[str | None, list[int]]]  # (text if known, token ids)
    params: SamplingParams
    num_top_logprobs: int
    abort: Callable[[str], None]
    engine_ids: list[str] = field(default_factory=list)
    created: int = field(default_factory=now_s)
    # Scoring (/v1/completions): echo + logprobs puts the prompt's logprobs first;
    # max_tokens 0 runs one step for them and drops the generated token.
    score_prompt: bool = False
    echo_without_generation: bool = False
    prompt_logprobs_requested: bool = True
    # Tools (chat): the parser of the model's tool-call block, the block start forced into
    # the prompt (tool_choice "required" or named), and whether one function was named.
    tool_parser: type[ToolCallParser] | None = None
    tool_prefix: str = ""
    named_tool: bool = False
    # X-data-parallel-rank: the DP rank every prompt of this request runs on (None: assigned)
    data_parallel_rank: int | None = None

    def new_tool_parser(self) -> ToolCallParser | None:
        if self.tool_parser is None:
            return None
        parser = self.tool_parser()
        parser.feed(self.tool_prefix)  # the prompt's forced start is part of the block
        return parser

    def abort_all(self) -> None:
        for engine_id in self.engine_ids:
            self.abort(engine_id)


def scoring_body(body: CompletionRequest) -> CompletionRequest:
    """What the engine runs for a completion request: echo + logprobs asks for the prompt's
    logprobs (as many alternatives as ``logprobs``), and max_tokens 0 runs one step (the
    generated token is dropped from the response)."""
    update: dict[str, Any] = {}
    if body.max_tokens == 0:
        update["max_tokens"] = 1
    if body.echo and body.logprobs is not None:
        update["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
    return body.model_copy(update=update) if update else body


class OpenAIServing:
    """Turns parsed requests into ``Prepared`` ones (``Responder`` runs them), and answers
    /v1/models, /tokenize and /detokenize."""

    def __init__(
        self,
        client: AsyncEngineClient,
        tokenizer: Any,
        served_model_names: tuple[str, ...],
        limits: RequestLimits | None = None,
        auto_tool_parser: str | None = None,
        max_logprobs: int = MAX_NUM_LOGPROBS,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names
        self.vocab_size = len(tokenizer)
        self.limits = RequestLimits() if limits is None else limits
        self.bounded = BoundedTokenizer(tokenizer)
        # set by --enable-auto-tool-choice --tool-call-parser NAME
        self.auto_tool_parser = auto_tool_parser
        self.max_logprobs = max_logprobs  # --max-logprobs

    def check_num_logprobs(self, body: Any, logprobs: int | None) -> None:
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", body.prompt_logprobs)):
            if value is not None and value > self.max_logprobs:
                raise ParamError(
                    f"{name} {value} is above this server's --max-logprobs {self.max_logprobs}",
                    "top_logprobs" if name == "logprobs" and isinstance(body.logprobs, bool)
                    else name,
                )  # fmt: skip

    # ---- tokenization --------------------------------------------------------------------
    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param
            )

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, **kwargs: Any) -> str:
        return self.bounded.render_chat(
            messages, add_generation_prompt, self.client.max_model_len, kwargs
        )

    def encode(
        self,
        text: str,
        add_special_tokens: bool,
        what: str = "prompt",
        keep_last: int | None = None,
    ) -> list[int]:
        max_model_len = self.client.max_model_len
        return self.bounded.encode(text, add_special_tokens, max_model_len, what, keep_last)

    # ---- preparing requests --------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest, request_id: str) -> Prepared:
        raw = body.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        self.limits.check(body, len(raw), self.vocab_size)
        prompts: list[tuple[str | None, list[int]]] = []
        for item in raw:
            if isinstance(item, str):
                ids = self.encode(
                    item, body.add_special_tokens, keep_last=body.truncate_prompt_tokens
                )
                prompts.append((item, ids))
            else:
                self.check_token_ids(item, "prompt")
                prompts.append((None, list(item)))
        prepared = self._prepare(scoring_body(body), request_id, prompts, body.logprobs, chat=False)
        prepared.score_prompt = body.echo and body.logprobs is not None
        prepared.echo_without_generation = body.max_tokens == 0
        prepared.prompt_logprobs_requested = body.prompt_logprobs is not None
        return prepared

    def prepare_chat(self, body: ChatCompletionRequest, request_id: str) -> Prepared:
        self.limits.check(body, 1, self.vocab_size)
        kwargs = dict(body.chat_template_kwargs or {})
        check_chat_template_kwargs(kwargs, self.limits.trust_request_chat_template)
        choice = body.effective_tool_choice
        if body.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        if choice == "auto" and body.tools and self.auto_tool_parser is None:
            raise ParamError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "tool_choice",
            )
        named = isinstance(choice, NamedToolChoice)
        prefix = forced_prefix(choice.model_dump() if named else choice)  # type: ignore[union-attr]
        text = self.render_chat(
            body.template_messages(),
            body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
        text += prefix
        ids = self.encode(text, body.add_special_tokens, "messages", body.truncate_prompt_tokens)
        prompt = (text, ids)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        parse_tools = bool(body.tools) and choice != "none"
        if parse_tools:  # a tool-call block may be made of special tokens (V4's are)
            body = body.model_copy(update={"skip_special_tokens": False})
        prepared = self._prepare(body, request_id, [prompt], logprobs, chat=True)
        if parse_tools:
            prepared.tool_parser = TOOL_PARSERS[self.auto_tool_parser or "deepseek_v4"]
            prepared.tool_prefix, prepared.named_tool = prefix, named
        return prepared

    def _prepare(
        self,
        body: Any,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        logprobs: int | None,
        chat: bool,
    ) -> Prepared:
        self.check_num_logprobs(body, logprobs)
        body.check_logit_bias(self.vocab_size)
        max_model_len = self.client.max_model_len
        what = "messages" if chat else "prompt"
        requested = body.max_completion_tokens if chat else None
        requested = requested or body.max_tokens
        max_tokens = 1
        for i, (text, ids) in enumerate(prompts):
            if body.truncate_prompt_tokens is not None:
                ids = ids[-body.truncate_prompt_tokens :]
                prompts[i] = (None if text is None else self.tokenizer.decode(ids), ids)
            if not ids:
                raise ParamError(f"the {what} is empty (no tokens)", what)
            if len(ids) >= max_model_len:
                raise ParamError(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"your request has {len(ids)} input tokens. Please reduce the length of "
                    f"the input {what}.",
                    what,
                )
            if requested is not None and len(ids) + requested > max_model_len:
                raise ParamError(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"you requested {len(ids) + requested} tokens ({len(ids)} in the {what}, "
                    f"{requested} in the completion). Please reduce the length of the {what} "
                    "or completion.",
                    "max_tokens",
                )
            # Without max_tokens a request may fill the context, as in vLLM.
            max_tokens = max(max_tokens, requested or max_model_len - len(ids))
        if body.stop_token_ids:
            self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        params = body.sampling_params(max_tokens, logprobs)
        kv = params.kv_transfer_params
        if kv is not None and kv.first_token_ids and (params.n > 1 or len(prompts) > 1):
            raise ParamError(
                "kv_transfer_params.first_token_ids is one completion's first token: it needs "
                "one prompt and n = 1 (each completion samples its own)",
                "kv_transfer_params",
            )
        try:  # an invalid schema, regex or grammar is the client's 400, not the engine's
            check_structured_outputs(params.structured_outputs)
        except ValueError as e:
            raise ParamError(str(e), body.structured_outputs_params()[1]) from None
        if requested is None and len(prompts) > 1:
            # one SamplingParams for all prompts: bound by the longest prompt's room
            room = max_model_len - max(len(ids) for _, ids in prompts)
            params = body.sampling_params(max(room, 1), logprobs)
        cap = self.limits.max_tokens_per_request
        if cap is not None and params.max_tokens > cap:  # max_tokens omitted: fill up to cap
            params = body.sampling_params(cap, logprobs)
        model = body.model or self.served_model_names[0]
        prefix = "chatcmpl" if chat else "cmpl"
        prepared = Prepared(
            chat,
            body,
            f"{prefix}-{request_id}",
            model,
            prompts,
            params,
            logprobs or 0,
            self.client.abort,
        )
        # Engine ids stay unique even when clients reuse an X-Request-Id.
        suffix = secrets.token_hex(4)
        prepared.engine_ids = [f"{request_id}-{i}-{suffix}" for i in range(len(prompts))]
        return prepared

    # ---- small endpoints -------------------------------------------------------------------
    def models(self, model_path: str, max_model_len: int) -> dict:
        created = now_s()
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "rackserve",
                    "root": model_path,
                    "parent": None,
                    "max_model_len": max_model_len,
                }
                for name in self.served_model_names
            ],
        }

    def tokenize(self, body: TokenizeRequest, max_model_len: int) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise ParamError("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            text = self.render_chat(messages, body.add_generation_prompt)
            ids = self.encode(text, bool(body.add_special_tokens))
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.encode(body.prompt or "", add_special)
        return {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    def detokenize(self, tokens: list[int]) -> str:
        self.check_token_ids(tokens, "tokens")
        return self.tokenizer.decode(tokens)
