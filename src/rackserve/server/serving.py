"""What the OpenAI endpoints do between parsing and the HTTP response: tokenize (chat
template), check lengths, turn engine outputs into OpenAI responses and SSE chunks.

One client request may hold several prompts (``/v1/completions`` accepts a list); each is
one engine request (``n`` completions), and choice ``index = prompt_index * n + i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from fastapi.responses import JSONResponse

from rackserve.engine.request_output import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    TokenLogprob,
)
from rackserve.request import MAX_NUM_LOGPROBS, KVTransferParams, SamplingParams
from rackserve.runner.structured_output import check_structured_outputs
from rackserve.server.async_client import (
    AsyncEngineClient,
    EngineDeadError,
    KVLoadFailedError,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
    ServerShutdownError,
)
from rackserve.server.limits import RequestLimits
from rackserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ParamError,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    now_s,
    prompt_logprobs_json,
    usage,
)
from rackserve.server.tokenization import BoundedTokenizer, check_chat_template_kwargs
from rackserve.server.tools import TOOL_PARSERS, ToolCallParser, forced_prefix

SSE_DONE = "data: [DONE]\n\n"
logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with OpenAI's envelope ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "authentication_error" if self.status == 401 else "invalid_request_error"

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def as_api_error(error: BaseException) -> ApiError:
    """The HTTP error for an exception raised while a request ran."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestRejectedError):
        return ApiError(400, str(error))
    if isinstance(error, ServerShutdownError):
        return ApiError(503, "The server shut down before this request finished.")
    if isinstance(error, EngineDeadError):
        # The reason (a traceback's last line) goes to the server log, not to clients.
        return ApiError(500, "The engine died while serving this request.")
    if isinstance(error, RequestAbortedError):
        return ApiError(499, str(error))
    if isinstance(error, KVLoadFailedError):  # the cause is the deployment's, not the input
        logger.error("%s", error)
        return ApiError(500, f"{error} (kv_load_failure_policy 'recompute' computes it here)")
    if isinstance(error, RequestFailedError):
        logger.error("request failed: %s", error)
        return ApiError(500, "Internal server error: this request's output could not be processed.")
    logger.error("request failed", exc_info=error)
    return ApiError(500, "Internal server error.")


def sse(payload: Any) -> str:
    return f"data: {msgspec.json.encode(payload).decode()}\n\n"


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

    @staticmethod
    def _finish_reason(prepared: Prepared, c: CompletionOutput, num_calls: int) -> str | None:
        if num_calls and c.finish_reason == "stop" and not prepared.named_tool:
            return "tool_calls"
        return c.finish_reason

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

    # ---- running ---------------------------------------------------------------------------
    async def _outputs(
        self, prepared: Prepared, kind: RequestOutputKind
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt, merged as they arrive."""
        body = prepared.body
        generators = [
            self.client.generate(
                engine_id,
                ids,
                prepared.params,
                prompt=text,
                kind=kind,
                priority=body.priority,
                cache_salt=body.cache_salt,
                data_parallel_rank=prepared.data_parallel_rank,
            )
            for engine_id, (text, ids) in zip(prepared.engine_ids, prepared.prompts, strict=True)
        ]
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, generator: AsyncIterator[RequestOutput]) -> None:
            try:
                async with contextlib.aclosing(generator):  # type: ignore[type-var]
                    async for output in generator:
                        queue.put_nowait((i, output))
                queue.put_nowait((i, None))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, prepared: Prepared) -> dict:
        """The whole (non-streaming) response."""
        finals: dict[int, RequestOutput] = {}
        async for i, output in self._outputs(prepared, RequestOutputKind.FINAL_ONLY):
            finals[i] = output
        n = prepared.params.n
        choices, num_completion, num_cached = [], 0, 0
        for i in range(len(prepared.prompts)):
            output = finals[i]
            num_cached += output.num_cached_tokens
            for c in output.outputs:
                if not prepared.chat:
                    c = self._generated(prepared, c)
                num_completion += len(c.token_ids)
                choice: dict[str, Any] = {"index": i * n + c.index}
                if prepared.chat:
                    finish_reason = c.finish_reason
                    choice["message"] = {"role": "assistant", "content": c.text}
                    parser = prepared.new_tool_parser()
                    if parser is not None:
                        content, calls = parser.parse(c.text)
                        choice["message"] = {
                            "role": "assistant",
                            "content": content if content or not calls else None,
                            "tool_calls": calls,
                        }
                        finish_reason = self._finish_reason(prepared, c, len(calls))
                    choice["logprobs"] = (
                        None
                        if c.logprobs is None
                        else chat_logprobs(c.logprobs, prepared.num_top_logprobs)
                    )
                else:
                    prompt_entries = self._prompt_entries(prepared, i, output)
                    choice["text"] = self._echo(prepared, i) + c.text
                    choice["logprobs"] = (
                        None
                        if c.logprobs is None
                        else completion_logprobs(
                            prompt_entries + c.logprobs, prepared.num_top_logprobs, 0
                        )
                    )
                    if prepared.prompt_logprobs_requested:
                        choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
                    finish_reason = c.finish_reason
                choice.update(finish_reason=finish_reason, stop_reason=c.stop_reason)
                choices.append(choice)
        num_prompt = sum(len(ids) for _, ids in prepared.prompts)
        response = {
            "id": prepared.response_id,
            "object": "chat.completion" if prepared.chat else "text_completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": choices,
            "usage": usage(num_prompt, num_completion, num_cached),
        }
        if prepared.chat:
            response["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs)
        kv_params = self._kv_transfer_params(prepared, num_cached, finals)
        if kv_params is not None:
            response["kv_transfer_params"] = kv_params
        return response

    def _kv_transfer_params(
        self, prepared: Prepared, num_cached: int, finals: dict[int, RequestOutput]
    ) -> dict | None:
        """A prefill engine's answer to ``do_remote_decode``: where the decode engine pulls
        the prompt's KV from (the router passes it on as vLLM's proxy does); with DP ranks,
        the port of the rank that ran it. One prompt, one completion: the token it sampled
        too, which the decode engine emits on arrival (``KVTransferParams``)."""
        params = prepared.params.kv_transfer_params
        config = getattr(self.client, "engine_config", None)
        disagg = None if config is None else config.kv_transfer
        if params is None or not params.do_remote_decode or disagg is None:
            return None
        port = disagg.kv_port
        if hasattr(self.client, "kv_transfer_port"):  # DP ranks (engine/dp_client.py)
            port = self.client.kv_transfer_port(finals[0].request_id, port)
        answer = KVTransferParams(
            do_remote_prefill=True,
            transfer_id=params.transfer_id,
            remote_host=disagg.kv_ip,
            remote_port=port,
            remote_engine_id=disagg.engine_id or f"{disagg.kv_ip}:{port}",
            num_cached_tokens=num_cached,
        )
        outputs = finals[0].outputs
        if len(finals) == 1 and params.num_consumers == 1 and len(outputs) == 1:
            first = outputs[0]
            if len(first.token_ids) == 1 and first.finish_reason != "abort":
                logprobs = None
                if first.logprobs is not None:
                    logprobs = tuple(
                        ((e.token_id, *(t for t, _, _ in e.top)),
                         (e.logprob, *(v for _, _, v in e.top)), e.rank)
                        for e in first.logprobs
                    )  # fmt: skip
                answer = replace(
                    answer, first_token_ids=tuple(first.token_ids), first_logprobs=logprobs
                )
        return answer.to_dict()

    @staticmethod
    def _generated(prepared: Prepared, c: CompletionOutput) -> CompletionOutput:
        """The completion as the client sees it: nothing when max_tokens was 0."""
        if not prepared.echo_without_generation:
            return c
        return replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])

    def _prompt_entries(
        self, prepared: Prepared, prompt_index: int, output: RequestOutput
    ) -> list[TokenLogprob | str]:
        """The prompt's logprob entries when scoring (the first token, which has none, as
        its text), else nothing."""
        if not prepared.score_prompt:
            return []
        _, ids = prepared.prompts[prompt_index]
        entries = output.prompt_logprobs
        if entries is None or len(entries) != len(ids):
            raise RuntimeError(
                f"the engine returned {0 if entries is None else len(entries)} prompt "
                f"logprobs for a prompt of {len(ids)} tokens"
            )
        return [
            self.tokenizer.decode([token_id]) if e is None else e
            for token_id, e in zip(ids, entries, strict=True)
        ]

    def _echo(self, prepared: Prepared, prompt_index: int) -> str:
        if prepared.chat or not prepared.body.echo:
            return ""
        text, ids = prepared.prompts[prompt_index]
        return text if text is not None else self.tokenizer.decode(ids)

    async def stream(self, prepared: Prepared) -> AsyncIterator[str]:
        """SSE chunks as OpenAI/vLLM send them, ending with ``data: [DONE]``."""
        body, n, chat = prepared.body, prepared.params.n, prepared.chat
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats
        num_prompt = sum(len(ids) for _, ids in prepared.prompts)
        head = {
            "id": prepared.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": prepared.created,
            "model": prepared.model,
        }
        num_completion, cached = 0, [0] * len(prepared.prompts)
        latest: dict[int, RequestOutput] = {}  # each prompt's last output (kv_transfer_params)
        text_offsets: dict[int, int] = {}
        tool_parsers: dict[int, ToolCallParser | None] = {}

        def chunk(choices: list[dict]) -> str:
            payload = {**head, "choices": choices}
            if include_usage:
                payload["usage"] = (
                    usage(num_prompt, num_completion, sum(cached)) if continuous else None
                )
            return sse(payload)

        if chat:  # the role first, once per choice, as OpenAI does
            for i in range(len(prepared.prompts) * n):
                delta = {"role": "assistant", "content": ""}
                yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        async for i, output in self._outputs(prepared, RequestOutputKind.DELTA):
            cached[i] = output.num_cached_tokens
            latest[i] = output
            for c in output.outputs:
                if not chat:
                    c = self._generated(prepared, c)
                num_completion += len(c.token_ids)
                index = i * n + c.index
                text = c.text
                prompt_entries: list[TokenLogprob | str] = []
                if not chat and index not in text_offsets:
                    text = self._echo(prepared, i) + text
                    text_offsets[index] = 0
                    prompt_entries = self._prompt_entries(prepared, i, output)
                tool_calls: list[dict] = []
                finish_reason = c.finish_reason
                if index not in tool_parsers:
                    tool_parsers[index] = prepared.new_tool_parser()
                parser = tool_parsers[index]
                if parser is not None:
                    num_before = len(parser.calls)
                    text, tool_calls = parser.feed(text)
                    if c.finished:
                        text += parser.finish()
                    tool_calls = [{"index": num_before + k, **t} for k, t in enumerate(tool_calls)]
                    finish_reason = self._finish_reason(prepared, c, len(parser.calls))
                wants_logprobs = c.logprobs is not None and bool(c.token_ids or prompt_entries)
                if not text and not c.finished and not wants_logprobs and not tool_calls:
                    continue  # nothing to say yet (held back, or a partial character)
                choice: dict[str, Any] = {"index": index}
                logprobs = None
                if chat:
                    choice["delta"] = {"content": text} if text or not c.finished else {}
                    if tool_calls:
                        choice["delta"]["tool_calls"] = tool_calls
                    if c.logprobs is not None:
                        logprobs = chat_logprobs(c.logprobs, prepared.num_top_logprobs)
                else:
                    choice["text"] = text
                    if c.logprobs is not None:
                        offset = text_offsets.get(index, 0)
                        logprobs = completion_logprobs(
                            prompt_entries + c.logprobs, prepared.num_top_logprobs, offset
                        )
                    text_offsets[index] = text_offsets.get(index, 0) + len(text)
                choice.update(
                    logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason
                )
                yield chunk([choice])
        if include_usage:
            yield sse(
                {**head, "choices": [], "usage": usage(num_prompt, num_completion, sum(cached))}
            )
        # a prefill engine's streamed answer to do_remote_decode (the router streams its
        # first token to the client at once): the transfer parameters come last, on their own
        kv_params = self._kv_transfer_params(prepared, sum(cached), latest)
        if kv_params is not None:
            yield sse({**head, "choices": [], "kv_transfer_params": kv_params})
        yield SSE_DONE

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
