"""Which engine holds which prefix: the KV-aware policy's view.

Two sources, one index:

- KV events (``--kv-events tcp://...`` per engine, kv/events.py): each engine publishes the
  chained prefix hashes of its anchor group's blocks as they are stored or removed, with the
  tier ("device" or "pool"). The router hashes a prompt's tokens the same way (``TokenKeyer``:
  the model's tokenizer and chat template, kv/hashing.py at the engine's granularity) and
  counts the leading blocks an engine holds.
- Without events, the router's own record (``TextKeyer``): the text blocks of every prompt
  it sent to an engine, LRU-capped, as SGLang's cache-aware router does. Approximate (it
  cannot see evictions) but needs neither a tokenizer nor engine support.

Prefix match::

    prompt blocks   h0 h1 h2 h3 h4 h5
    device          h0 h1 h2            -> 3 device blocks
    pool                     h3 h4      -> then 2 pool blocks (loaded, not recomputed)
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)
TEXT_BLOCK_CHARS = 64  # approximate mode: prefix blocks of this many characters
# a prompt of token ids: blocks of this many ids, counted as TEXT_BLOCK_CHARS characters
# (about 4 a token) so that the load term weighs both kinds of prompt alike
TOKEN_BLOCK_IDS = 16
DEFAULT_APPROX_CAPACITY = 200_000  # approximate mode: blocks remembered per engine


class TextKeyer:
    """A request body's chained hashes over fixed-size character blocks of its prompt text
    (chat: role and content of each message, in order), and the characters they cover."""

    block_chars = TEXT_BLOCK_CHARS

    def keys(self, body: dict[str, Any]) -> tuple[list[bytes], int]:
        """(the chained block hashes, the characters a block counts for). A prompt of token
        ids is keyed by its ids (8 bytes each, TOKEN_BLOCK_IDS a block); anything that is
        neither raises (the caller routes by load then)."""
        salt = str(body.get("cache_salt") or "").encode()
        ids = prompt_ids(body)
        if ids is not None:
            data, step = array("q", ids).tobytes(), 8 * TOKEN_BLOCK_IDS
            parent = hashlib.sha256(b"rackserve/router/ids" + salt).digest()
        else:
            data = prompt_text(body).encode("utf-8", "surrogatepass")
            step = self.block_chars
            parent = hashlib.sha256(b"rackserve/router/text" + salt).digest()
        hashes = []
        for start in range(0, len(data) - step + 1, step):
            parent = hashlib.blake2b(parent + data[start : start + step], digest_size=16).digest()
            hashes.append(parent)
        return hashes, self.block_chars


class TokenKeyer:
    """The engines' own block hashes of a request's prompt tokens (events mode)."""

    def __init__(self, model_dir: str, tokenizer_dir: str | None, hash_algo: str) -> None:
        from transformers import AutoTokenizer

        from rackserve.config import ModelConfig
        from rackserve.kv.spec import cache_groups_for, hash_granularity

        specs = cache_groups_for(ModelConfig.from_pretrained(model_dir))
        self.granularity = hash_granularity(specs)
        anchor = next((s for s in specs if not s.is_sliding), specs[0])
        self.block_tokens = anchor.block_tokens
        self.hash_algo = hash_algo
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)

    def token_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the server makes them (server/tokenization.py): a chat
        is rendered to text, then encoded without special tokens unless asked."""
        if "messages" in body:
            text = self.tokenizer.apply_chat_template(
                body["messages"],
                tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True),
            )
            special = bool(body.get("add_special_tokens", False))
            return self.tokenizer.encode(text, add_special_tokens=special)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return self.tokenizer.encode(str(prompt), add_special_tokens=True)

    def keys(self, body: dict[str, Any]) -> tuple[list[bytes], int]:
        from rackserve.kv.hashing import BlockHashChain

        chain = BlockHashChain(self.granularity, body.get("cache_salt"), self.hash_algo)
        ids = self.token_ids(body)
        chain.extend(ids)
        step = self.block_tokens
        ends = range(step, chain.num_tokens + 1, step)
        return [chain.prefix_hash(end) for end in ends], step


def prompt_ids(body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids (the first of a batch), else None."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if isinstance(prompt[0], list):  # a batch of token-id prompts
        prompt = prompt[0]
    return prompt if not prompt or isinstance(prompt[0], int) else None


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                content = message.get("content")
                if not isinstance(content, str):
                    content = repr(content)
                parts.append(f"<{message.get('role')}>{content}")
        return "".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else repr(prompt)


class KVIndex:
    """Per engine, the resident block hashes by tier. Thread-safe (event thread + server)."""

    def __init__(self, num_engines: int, approx_capacity: int = DEFAULT_APPROX_CAPACITY):
        self.device: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_engines)]
        self.pool: list[set[bytes]] = [set() for _ in range(num_engines)]
        self.approx_capacity = approx_capacity
        self.last_seq: list[int | None] = [None] * num_engines
        self.engine_ids: list[str | None] = [None] * num_engines  # publisher of the view
        self.num_gaps = 0
        self.num_restarts = 0
        self._lock = threading.Lock()

    def match(self, engine: int, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(leading blocks on the device, then leading blocks in the pool)."""
        with self._lock:
            device, pool = self.device[engine], self.pool[engine]
            n = 0
            while n < len(hashes) and hashes[n] in device:
                n += 1
            m = n
            while m < len(hashes) and hashes[m] in pool:
                m += 1
            return n, m - n

    def record_routed(self, engine: int, hashes: Sequence[bytes]) -> None:
        """Approximate mode: the engine will hold this prompt's blocks (LRU-capped)."""
        with self._lock:
            device = self.device[engine]
            for h in hashes:
                device[h] = None
                device.move_to_end(h)
            while len(device) > self.approx_capacity:
                device.popitem(last=False)

    def grow(self, num_engines: int) -> None:
        """Room for ``num_engines`` (the DP ranks of an engine, learned after start)."""
        with self._lock:
            for _ in range(len(self.device), num_engines):
                self.device.append(OrderedDict())
                self.pool.append(set())
                self.last_seq.append(None)
                self.engine_ids.append(None)

    def forget_engine(self, engine: int) -> None:
        """A restarted engine holds nothing."""
        with self._lock:
            self.device[engine].clear()
            self.pool[engine].clear()
            self.last_seq[engine] = None
            self.engine_ids[engine] = None

    def apply(self, engine: int, batch: Any) -> None:
        """One KVEventBatch (kv/events.py) from ``engine``."""
        with self._lock:
            known = self.engine_ids[engine]
            if known is not None and batch.engine_id != known:
                # Another process on that endpoint (a restart): what the old one held is
                # gone; without this the view would keep the dead engine's blocks.
                self.device[engine].clear()
                self.pool[engine].clear()
                self.last_seq[engine] = None
                self.num_restarts += 1
            self.engine_ids[engine] = batch.engine_id
            last = self.last_seq[engine]
            if last is not None and batch.seq != last + 1:
                self.num_gaps += 1  # missed batches: the view may be stale until evictions
            self.last_seq[engine] = batch.seq
            device, pool = self.device[engine], self.pool[engine]
            for event in batch.events:
                kind = type(event).__name__
                if kind == "AllBlocksCleared":
                    device.clear()
                    pool.clear()
                    continue
                target: Any = device if event.medium == "device" else pool
                for h in event.block_hashes:
                    if kind == "BlockStored":
                        if target is device:
                            device[h] = None
                        else:
                            pool.add(h)
                    elif target is device:
                        device.pop(h, None)
                    else:
                        pool.discard(h)


class EventSubscriber:
    """A ZMQ SUB thread per router: batches from each engine's endpoint into the index
    (endpoint i feeds candidate i; :meth:`add` subscribes a DP rank's endpoint later)."""

    def __init__(
        self,
        index: KVIndex,
        endpoints: Sequence[str],
        decode: Callable[[bytes], Any] | None = None,
    ) -> None:
        import zmq

        if decode is None:
            from rackserve.kv.events import decode_batch as decode
        self.index = index
        self.decode = decode
        self._context = zmq.Context()
        self._sockets = []
        for endpoint in endpoints:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._sockets.append(sock)
        self._pending: list[tuple[str, int]] = []
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        engine_of = {sock: i for i, sock in enumerate(self._sockets)}
        while not self._stop.is_set():
            with self._pending_lock:
                pending, self._pending = self._pending, []
            for endpoint, engine in pending:  # sockets belong to this thread from here
                sock = self._context.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                self._sockets.append(sock)
                poller.register(sock, zmq.POLLIN)
                engine_of[sock] = engine
            for sock, _ in poller.poll(100):
                data = sock.recv()
                try:
                    batch = self.decode(data)
                except Exception as e:  # a bad message is the publisher's bug, not ours
                    logger.warning("dropped a malformed KV event batch: %s", e)
                    continue
                self.index.apply(engine_of[sock], batch)

    def add(self, endpoint: str, engine: int) -> None:
        """Subscribe to ``endpoint`` too, its batches feeding candidate ``engine`` (the
        thread connects it within a poll interval)."""
        with self._pending_lock:
            self._pending.append((endpoint, engine))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for sock in self._sockets:
            sock.close(0)
        self._context.term()
