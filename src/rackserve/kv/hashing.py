"""Chained prefix hashes over token ids, deterministic across processes and hosts.

``h_i = H(h_{i-1}, tokens[i*G:(i+1)*G], extra_keys)`` with ``h_{-1}`` the root, derived from
the request's cache salt (or a constant without one). ``h_i`` therefore names the whole
prefix ``[0, (i+1)*G)``: the cache key of a group's block ending at token position ``e`` is
``(group_name, h[e // G - 1])``.

Token ids are packed as little-endian int64 with ``struct`` (never Python's ``hash``, which is
salted per process), so P/D peers and restarted engines agree on every key.

A hit is taken on the key alone (token ids are not compared), so the hash must not collide,
even for crafted prompts: sha256 is the default (as in vLLM); xxhash (xxh3-128, faster, not
collision-resistant against an adversary) is an option for trusted workloads. Requests of
different tenants should carry different cache salts: then they share no key at all, and
no tenant can learn from its hit timing what another one sent.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Literal

import xxhash

HashAlgo = Literal["xxhash", "sha256"]
HASH_ALGOS: tuple[str, ...] = ("xxhash", "sha256")

BlockHash = bytes
BlockKey = tuple[str, BlockHash]  # (cache group name, prefix hash)

_ROOT_TAG = b"rackserve/kv/prefix/v1"


def check_hash_algo(algo: str) -> None:
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown prefix hash {algo!r}; choose one of {HASH_ALGOS}")


def _sha256_digest(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()


_DIGESTS = {"xxhash": xxhash.xxh3_128_digest, "sha256": _sha256_digest}  # 16 / 32 bytes
_NO_EXTRA_KEYS = struct.pack("<I", 0)  # hash_tokens' extra-key framing for b""


def _digest(data: bytes, algo: str) -> BlockHash:
    if algo == "xxhash":
        return xxhash.xxh3_128_digest(data)  # 16 bytes
    if algo == "sha256":
        return hashlib.sha256(data).digest()  # 32 bytes
    raise ValueError(f"unknown prefix hash {algo!r}; choose one of {HASH_ALGOS}")


def root_hash(cache_salt: str | None, algo: str = "sha256") -> BlockHash:
    """The parent of the first chunk; requests with different salts share no key."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return _digest(_ROOT_TAG + salt, algo)


def hash_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"", algo: str = "sha256"
) -> BlockHash:
    """One link of the chain: ``H(parent, token_ids, extra_keys)``.

    The extra-key length is framed so (tokens, extra) pairs can never collide by shifting
    bytes between the two fields.
    """
    data = b"".join(
        (
            parent,
            struct.pack("<I", len(extra_keys)),
            extra_keys,
            struct.pack(f"<{len(token_ids)}q", *token_ids),
        )
    )
    return _digest(data, algo)


class BlockHashChain:
    """A request's prefix hashes, one per complete ``granularity``-token chunk, extended
    incrementally as tokens are appended (``hashes[i]`` names tokens ``[0, (i+1)*G)``)."""

    def __init__(
        self, granularity: int, cache_salt: str | None = None, algo: str = "sha256"
    ) -> None:
        if granularity < 1:
            raise ValueError(f"hash granularity must be >= 1, got {granularity}")
        check_hash_algo(algo)
        self.granularity = granularity
        self.algo = algo
        self.root = root_hash(cache_salt, algo)
        self.hashes: list[BlockHash] = []
        # Compiled once: decode steps hash one small chunk at a time, where hash_tokens'
        # per-call format string and joins cost more than the hash itself.
        self._pack_chunk = struct.Struct(f"<{granularity}q").pack
        self._chunk_digest = _DIGESTS[algo]

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the chain so far (a multiple of the granularity)."""
        return len(self.hashes) * self.granularity

    def extend(self, all_token_ids: Sequence[int]) -> int:
        """Hash the complete chunks of ``all_token_ids`` not hashed yet; returns how many.
        ``all_token_ids`` must start with the tokens already hashed (it only ever grows)."""
        g = self.granularity
        start, stop = len(self.hashes), len(all_token_ids) // g
        parent = self.hashes[-1] if self.hashes else self.root
        pack, digest, append = self._pack_chunk, self._chunk_digest, self.hashes.append
        for i in range(start * g, stop * g, g):
            # == hash_tokens(parent, all_token_ids[i : i + g], algo=self.algo)
            parent = digest(parent + _NO_EXTRA_KEYS + pack(*all_token_ids[i : i + g]))
            append(parent)
        return max(0, stop - start)

    def prefix_hash(self, end: int) -> BlockHash:
        """The hash of tokens ``[0, end)``; ``end`` is a positive multiple of the granularity
        not beyond :attr:`num_tokens`."""
        if end <= 0 or end % self.granularity or end > self.num_tokens:
            raise ValueError(
                f"no prefix hash for end={end} (granularity {self.granularity}, "
                f"{self.num_tokens} tokens hashed)"
            )
        return self.hashes[end // self.granularity - 1]


def block_key(group: str, chain: BlockHashChain, end: int) -> BlockKey:
    """Cache key of ``group``'s block that ends at token position ``end``."""
    return (group, chain.prefix_hash(end))
