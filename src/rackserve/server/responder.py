"""Answering a prepared request: its prompts run on the engine, their outputs merged as
they arrive, and turned into the whole OpenAI response (``collect``) or its SSE chunks
(``stream``): echo and prompt scoring, tool calls, and a P/D prefill's
``kv_transfer_params``.

Each prompt is one engine request (``n`` completions), and choice
``index = prompt_index * n + i``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from rackserve.engine.request_output import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    TokenLogprob,
)
from rackserve.request import KVTransferParams
from rackserve.server.async_client import AsyncEngineClient
from rackserve.server.responses import (
    SSE_DONE,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    sse,
    usage,
)
from rackserve.server.serving import Prepared
from rackserve.server.tools import ToolCallParser


class Responder:
    """Runs the requests ``OpenAIServing`` prepared and builds their responses."""

    def __init__(self, client: AsyncEngineClient, tokenizer: Any) -> None:
        self.client = client
        self.tokenizer = tokenizer

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

    @staticmethod
    def _finish_reason(prepared: Prepared, c: CompletionOutput, num_calls: int) -> str | None:
        if num_calls and c.finish_reason == "stop" and not prepared.named_tool:
            return "tool_calls"
        return c.finish_reason

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
