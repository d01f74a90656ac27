"""Chained prefix hashes: chaining, salts, algorithms, determinism, incremental extension."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash

from rackserve.kv.hashing import BlockHashChain, block_key, hash_tokens, root_hash


def chain_of(tokens, granularity=4, salt=None, algo=None) -> list[bytes]:
    chain = (
        BlockHashChain(granularity, salt)
        if algo is None
        else BlockHashChain(granularity, salt, algo)
    )
    chain.extend(tokens)
    return chain.hashes


def test_format_is_pinned_and_process_independent():
    # The bytes hashed are part of the P/D and restart contract: pin them (default: sha256).
    root = hashlib.sha256(b"rackserve/kv/prefix/v1\x00").digest()
    first = hashlib.sha256(root + struct.pack("<I", 0) + struct.pack("<4q", 0, 1, 2, 3)).digest()
    hashes = chain_of(list(range(10)))
    assert len(hashes) == 2  # the partial chunk [8, 10) is not hashed
    assert hashes[0] == first
    assert hashes[0].hex() == "0fc06d48ba9c6ccabb6f9a98aaa8c413695dce7e5c3d61e154a845b45c5427f3"
    assert hashes[1].hex() == "ba59b4a454a05a06188bf636377a63d22d215f2004dc9e93e90daf322fce67b2"


def test_xxhash_option():
    root = xxhash.xxh3_128_digest(b"rackserve/kv/prefix/v1\x01u")
    hashes = chain_of(list(range(8)), salt="u", algo="xxhash")
    assert [len(h) for h in hashes] == [16, 16]
    first = xxhash.xxh3_128_digest(root + struct.pack("<I", 0) + struct.pack("<4q", 0, 1, 2, 3))
    assert hashes[0] == first
    assert hashes[0] != chain_of(list(range(8)), salt="u")[0]
    assert chain_of(list(range(10)), algo="xxhash")[1].hex() == "a86bd5ad63ce06031aa35b9ad923585a"
    with pytest.raises(ValueError, match="choose one of"):
        BlockHashChain(4, algo="md5")


def test_same_prefix_same_hashes_and_earlier_token_changes_all_later():
    base = list(range(100, 124))  # 6 chunks of 4
    other = list(base)
    other[9] = 7  # inside chunk 2
    a, b = chain_of(base), chain_of(other)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert chain_of(base[:13]) == a[:3]  # a shorter request shares the prefix hashes


def test_salt_changes_every_hash():
    tokens = list(range(16))
    plain, alice, bob = (
        chain_of(tokens),
        chain_of(tokens, salt="alice"),
        chain_of(tokens, salt="bob"),
    )
    for x, y, z in zip(plain, alice, bob, strict=True):
        assert len({x, y, z}) == 3
    assert root_hash(None) != root_hash("")  # no salt differs from an empty salt


def test_extra_keys_are_framed():
    root = root_hash(None)
    assert hash_tokens(root, [1, 2]) != hash_tokens(root, [1, 2], extra_keys=b"img0")
    # Moving bytes between tokens and extra keys cannot collide thanks to the length prefix.
    assert hash_tokens(root, [1], extra_keys=b"") != hash_tokens(
        root, [], extra_keys=struct.pack("<q", 1)
    )


def test_incremental_extend_matches_one_shot():
    tokens = list(range(1000, 1037))
    chain = BlockHashChain(4)
    assert chain.extend(tokens[:3]) == 0
    assert chain.extend(tokens[:9]) == 2
    assert chain.extend(tokens[:9]) == 0
    assert chain.extend(tokens) == 7
    assert chain.hashes == chain_of(tokens) and chain.num_tokens == 36


def test_prefix_hash_and_block_key():
    chain = BlockHashChain(8)
    chain.extend(list(range(40)))
    assert chain.prefix_hash(16) == chain.hashes[1]
    assert block_key("csa_kv", chain, 32) == ("csa_kv", chain.hashes[3])
    for bad in (0, 12, 48):
        with pytest.raises(ValueError):
            chain.prefix_hash(bad)
