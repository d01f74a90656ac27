"""Step 1 of a P/D request: the prompt on a prefill engine (router/app.py runs step 2).

``run`` waits for the prefill engine's answer and returns the decode request with the
answer's ``kv_transfer_params``. ``start_overlapped`` (``--overlap-transfer``) sends the
prefill request in the background and returns the decode request at once: it names the
prefill candidate's KV address, learned from that candidate's earlier answers, so the
decode side's streaming pull starts while the prefill computes. A DP prefill engine's rank
r, pinned by the router, serves on kv_port + r, so each rank candidate learns its own
address.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from prometheus_client import Counter, Histogram

from rackserve.router.engines import Choice, EnginePool
from rackserve.router.first_token import PrefillStream

RETRY_STATUSES = (502, 503)  # the engine is going away: nothing of the request ran
JSON_HEADERS = {"Content-Type": "application/json"}


def json_bytes(body: dict[str, Any]) -> bytes:
    """A request body as sent on (msgspec: 14x json.dumps on a 16K-id prompt, 0.05 ms)."""
    return msgspec.json.encode(body)


class NotStarted(Exception):
    """The engine could not take the request (unreachable, or 502/503): retry elsewhere."""


class FirstTokenSent(NotStarted):
    """A streamed prefill answer broke after its first chunks went to the client: no retry
    can take them back, so the request ends with an error event."""


OnFirst = Callable[..., Awaitable[None]]  # (chunks: bytes, label: str) -> None


def prefill_body(body: dict[str, Any], transfer_id: str, stream: bool = False) -> dict[str, Any]:
    """Step 1's request: the prompt, one token, the transfer parameters; streamed (with the
    client's stream options) when its first chunks go to the client (router/first_token.py).
    The token is the request's first (the decode side emits it): min_tokens >= 1 keeps EOS
    masked for it, as an aggregated engine would."""
    min_tokens = body.get("min_tokens")
    wants_one = isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 0
    first = dict(body, stream=stream, max_tokens=1, n=1, min_tokens=1 if wants_one else 0)
    if not stream:
        first.pop("stream_options", None)
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    first["kv_transfer_params"] = {
        "do_remote_decode": True, "transfer_id": transfer_id, "num_consumers": max(1, n),
    }  # fmt: skip
    return first


def decode_alone(body: dict[str, Any]) -> bool:
    """Requests that need every prompt position's logits: the decode side computes them."""
    return body.get("prompt_logprobs") is not None or bool(body.get("echo"))


class PrefillStep:
    """The prefill pool, the KV addresses learned from its answers, and the overlapped
    prefills still running. ``requests``, ``retries`` and ``seconds`` are the router's
    metrics (requests by engine and role, retries, the prefill round trip)."""

    def __init__(
        self, pool: EnginePool, requests: Counter, retries: Counter, seconds: Histogram
    ) -> None:
        self.pool = pool
        self.requests, self.retries, self.seconds = requests, retries, seconds
        # prefill candidate label -> its KV address, None once two answers named different ones
        self.kv_addresses: dict[str, tuple[str, int] | None] = {}
        self._tasks: set[asyncio.Task] = set()

    async def run(
        self,
        http: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any],
        session: str | None,
        headers: dict[str, str],
        on_first: OnFirst | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """(where the KV comes from, the decode request). A prefill side that is all down,
        or a request for the decode side alone, leaves the decode side to compute it.
        ``on_first``: the answer is streamed, and its first chunks go to it as they arrive
        (with the prefill engine's label); once it ran, the client has the first token."""
        if decode_alone(body):
            return "decode", body
        first = prefill_body(body, uuid.uuid4().hex, stream=on_first is not None)
        tried: set[int] = set()
        for _ in range(len(self.pool.engines)):
            try:
                choice = self.pool.choose(first, session, tried)
            except ValueError:
                break
            tried.add(choice.index)
            self.pool.start(choice, session)
            self.requests.labels(choice.engine.label, "prefill").inc()
            forward = None
            if on_first is not None:
                forward = functools.partial(on_first, label=choice.engine.label)
            try:
                status, payload = await self._post(http, choice, path, first, headers, forward)
            except (TimeoutError, aiohttp.ClientError, OSError, NotStarted) as e:
                self.pool.mark_down(choice.index, str(e) or type(e).__name__)
                self.retries.inc()
                if isinstance(e, FirstTokenSent):
                    raise
                continue
            finally:
                self.pool.finish(choice)
            if status != 200:  # the client's error: decode says it too
                return "decode", body
            params = self._learn(choice.engine.label, payload)
            if params is None:
                return "decode", body
            return f"prefill={choice.engine.label}", dict(body, kv_transfer_params=params)
        return "decode (prefill down)", body

    def start_overlapped(
        self,
        http: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any],
        session: str | None,
        headers: dict[str, str],
    ) -> tuple[str, dict[str, Any]] | None:
        """Send the prefill request in the background; (where the KV comes from, the
        decode request naming the prefill's KV address), or None (nothing sent) when that
        address is not known yet or the request is for the decode side alone."""
        if decode_alone(body):
            return None
        first = prefill_body(body, uuid.uuid4().hex)
        try:
            choice = self.pool.choose(first, session, set())
        except ValueError:
            return None
        address = self.kv_addresses.get(choice.engine.label)
        if address is None:
            return None
        self.pool.start(choice, session)
        self.requests.labels(choice.engine.label, "prefill").inc()
        task = asyncio.create_task(self._send(http, choice, path, first, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        params = {
            "do_remote_prefill": True, "transfer_id": first["kv_transfer_params"]["transfer_id"],
            "remote_host": address[0], "remote_port": address[1],
        }  # fmt: skip
        return f"prefill={choice.engine.label} (overlapped)", dict(body, kv_transfer_params=params)

    async def close(self) -> None:
        """Cancel the overlapped prefills still running."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send(
        self,
        http: aiohttp.ClientSession,
        choice: Choice,
        path: str,
        first: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        """An overlapped prefill: its answer only teaches the address (a failure leaves the
        decode side's pull to fail and apply its policy)."""
        try:
            _, payload = await self._post(http, choice, path, first, headers)
            self._learn(choice.engine.label, payload)
        except (TimeoutError, aiohttp.ClientError, OSError, NotStarted, ValueError) as e:
            self.pool.mark_down(choice.index, str(e) or type(e).__name__)
        finally:
            self.pool.finish(choice)

    async def _post(
        self,
        http: aiohttp.ClientSession,
        choice: Choice,
        path: str,
        first: dict[str, Any],
        headers: dict[str, str],
        forward: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> tuple[int, Any]:
        """The prefill request to ``choice``: (HTTP status, the parsed answer, for a streamed
        one {"kv_transfer_params": ...} from its last event); NotStarted on 502/503 (nothing
        ran there), FirstTokenSent if a streamed answer broke after ``forward`` sent its
        first chunks. Times the round trip."""
        url = f"{choice.engine.url}{path}"
        send_headers = {**headers, **choice.engine.headers, **JSON_HEADERS}
        sent_at = time.perf_counter()
        async with http.post(url, data=json_bytes(first), headers=send_headers) as upstream:
            if upstream.status in RETRY_STATUSES:
                raise NotStarted(f"HTTP {upstream.status}")
            if forward is None or upstream.status != 200:
                payload = await upstream.json(content_type=None)
            else:
                reader = PrefillStream(path.endswith("/chat/completions"))
                try:
                    async for data in upstream.content.iter_any():
                        ready = reader.feed(data)
                        if ready is not None:
                            await forward(ready)
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    if reader.first is not None:
                        raise FirstTokenSent(f"the prefill answer broke: {e}") from e
                    raise
                if reader.first is not None and reader.params is None:
                    raise FirstTokenSent("the prefill answer ended without kv_transfer_params")
                payload = {"kv_transfer_params": reader.params, "first_sent": reader.first}
        self.seconds.observe(time.perf_counter() - sent_at)
        return upstream.status, payload

    def _learn(self, label: str, payload: Any) -> dict[str, Any] | None:
        """The answer's ``kv_transfer_params`` (None without them); remembers the KV address
        they name for ``label``, the prefill candidate (a DP rank, pinned, keeps its
        address)."""
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        if not isinstance(params, dict):
            return None
        host, port = params.get("remote_host"), params.get("remote_port")
        if isinstance(host, str) and isinstance(port, int):
            if label not in self.kv_addresses:
                self.kv_addresses[label] = (host, port)
            elif self.kv_addresses[label] != (host, port):
                self.kv_addresses[label] = None  # unpinned DP ranks: the port varies
        return params
