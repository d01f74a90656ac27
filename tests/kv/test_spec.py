"""Cache groups derived from the model config, alignment, and KV sizing."""

from __future__ import annotations

import dataclasses

import pytest

from rackserve.kv.spec import (
    CacheGroupSpec,
    bytes_per_request,
    bytes_per_token,
    cache_groups_for,
    capacity_tokens,
    hash_granularity,
    plan_num_blocks,
    prefix_alignment,
)
from rackserve.model.presets import tiny_config, v4_flash_config


def by_name(specs) -> dict[str, CacheGroupSpec]:
    return {s.name: s for s in specs}


def test_tiny_preset_groups():
    specs = cache_groups_for(tiny_config())  # window 16, C4 / C16, head 64, index head 32
    assert [s.name for s in specs] == ["swa", "csa_state", "hca_state", "csa_kv", "hca_kv"]
    g = by_name(specs)
    assert g["swa"] == CacheGroupSpec("swa", (0, 1, 2, 3, 4, 5), 8, 1, 16, 64, 2)
    assert g["csa_state"] == CacheGroupSpec("csa_state", (1, 4), 8, 1, 8, 2 * 128 + 2 * 64, 2)
    assert g["hca_state"] == CacheGroupSpec("hca_state", (2, 5), 8, 1, 16, 128, 2)
    assert g["csa_kv"] == CacheGroupSpec("csa_kv", (1, 4), 32, 4, None, 64 + 32, 2)
    assert g["hca_kv"] == CacheGroupSpec("hca_kv", (2, 5), 32, 16, None, 64, 2)
    assert [s.entries_per_block for s in specs] == [8, 8, 8, 8, 2]
    assert [s.bytes_per_block for s in specs] == [6144, 12288, 4096, 3072, 512]
    assert [s.max_blocks_per_request for s in specs] == [3, 2, 3, None, None]
    assert prefix_alignment(specs) == 32 and hash_granularity(specs) == 8
    assert bytes_per_token(specs) == (3072 + 512) / 32


def test_v4_flash_groups():
    specs = cache_groups_for(v4_flash_config())
    g = by_name(specs)
    assert prefix_alignment(specs) == 256
    assert g["swa"].block_tokens == 64 and g["swa"].window == 128 and g["swa"].num_layers == 43
    assert g["csa_kv"].block_tokens == g["hca_kv"].block_tokens == 256
    assert g["csa_kv"].entries_per_block == 64 and g["hca_kv"].entries_per_block == 2
    assert g["csa_kv"].num_layers == 20 and g["hca_kv"].num_layers == 23
    assert g["csa_kv"].entry_width == 512 + 128
    assert g["csa_state"].entry_width == 2 * 1024 + 2 * 256 and g["csa_state"].window == 8
    # A state block never exceeds its window: the C4 state pages are 8 tokens, not 64.
    assert g["csa_state"].block_tokens == 8 and g["hca_state"].block_tokens == 64
    assert hash_granularity(specs) == 8
    assert bytes_per_token(specs) == 6584.0  # bf16 history, all 43 layers
    assert bytes_per_request(specs) == 3 * 2818048 + 2 * 819200 + 3 * 3014656


def test_sizes_follow_the_config():
    cfg = dataclasses.replace(tiny_config(), sliding_window=32, csa_ratio=8, hca_ratio=32)
    g = by_name(cache_groups_for(cfg))
    assert g["swa"].block_tokens == 16 and g["swa"].window == 32
    assert g["csa_state"].window == 16 and g["csa_state"].block_tokens == 16
    assert g["hca_state"].window == 32 and g["hca_state"].block_tokens == 16
    assert g["csa_kv"].block_tokens == 64 and g["csa_kv"].entries_per_block == 8
    # 2 * window = 32 rounded up to lcm(ratios, P) = 48 -> 48.
    cfg = dataclasses.replace(tiny_config(), sliding_window=16, csa_ratio=3, hca_ratio=16)
    specs = cache_groups_for(cfg)
    assert by_name(specs)["csa_kv"].block_tokens == 48
    assert by_name(specs)["csa_state"].block_tokens == 4  # largest divisor of 8 within 6
    assert prefix_alignment(specs) == 48 and hash_granularity(specs) == 4


def test_groups_without_layers_are_dropped():
    assert [s.name for s in cache_groups_for(tiny_config(num_layers=1))] == ["swa"]
    assert [s.name for s in cache_groups_for(tiny_config(num_layers=2))] == [
        "swa",
        "csa_state",
        "csa_kv",
    ]


def test_spec_validation_names_the_fix():
    with pytest.raises(ValueError, match="<= window"):
        CacheGroupSpec("swa", (0,), 32, 1, 16, 64, 2)
    with pytest.raises(ValueError, match="multiple of ratio"):
        CacheGroupSpec("kv", (0,), 30, 4, None, 64, 2)
    with pytest.raises(ValueError, match="ratio=1"):
        CacheGroupSpec("swa", (0,), 8, 2, 16, 64, 2)
    with pytest.raises(ValueError, match="layer_ids"):
        CacheGroupSpec("kv", (), 8, 1, None, 64, 2)


SMALL = [
    CacheGroupSpec("swa", (0, 1), 4, 1, 8, 16, 2),  # 256 bytes per block
    CacheGroupSpec("kv", (0,), 8, 2, None, 32, 2),  # 256 bytes per block, 32 per token
]


def test_plan_num_blocks_exact():
    # swa: 2 * (2 seqs * (ceil(7/4) + 1) + ceil(16/4) + 2) + 1 null = 25 blocks = 6400 bytes.
    # kv: (10000 - 6400 - 256 null) // 32 = 104 tokens -> 13 blocks + 1 null.
    num_blocks = plan_num_blocks(SMALL, 10_000, max_num_seqs=2, max_num_batched_tokens=16)
    assert num_blocks == {"swa": 25, "kv": 14}
    assert capacity_tokens(SMALL, num_blocks) == 104
    used = sum(num_blocks[s.name] * s.bytes_per_block for s in SMALL)
    assert used <= 10_000


def test_plan_num_blocks_too_small_budget():
    # Minimum: 6400 (swa) + (ceil(16/8) + 2) * 256 (one chunk of history) = 7424 bytes.
    assert plan_num_blocks(SMALL, 7424, 2, 16)["kv"] == 4
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        plan_num_blocks(SMALL, 7423, 2, 16)


def test_plan_v4_flash_budget():
    specs = cache_groups_for(v4_flash_config())
    num_blocks = plan_num_blocks(specs, 40 << 30, max_num_seqs=64, max_num_batched_tokens=8192)
    assert num_blocks["csa_kv"] == num_blocks["hca_kv"]
    total = sum(num_blocks[s.name] * s.bytes_per_block for s in specs)
    assert (40 << 30) - 2 * 1638400 < total <= 40 << 30
    assert capacity_tokens(specs, num_blocks) == (num_blocks["csa_kv"] - 1) * 256
