"""Sliding-window block tables as rings (slot j in column j % R): the tables do not grow with
max_model_len, and every engine path computes exactly what linear tables compute.

The linear baseline is the same engine with ``CacheGroupSpec.ring_blocks`` patched wide, so
that every table is linear (``table_widths``): both engines schedule the same steps over
the same blocks, only the table indirection differs, so logits must be bitwise equal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from rackserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import CacheGroupSpec, cache_groups_for, plan_num_blocks
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config, v4_flash_config
from rackserve.request import SamplingParams
from rackserve.runner.inputs import BlockTables, ring_widths, table_widths

MAX_STEP = 40  # max_num_batched_tokens: chunks wider than the tiny model's window (16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_ring"), seed=0)


def _prompts(lengths: list[int], seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"r{i}": torch.randint(10, 4000, (n,), generator=g).tolist() for i, n in enumerate(lengths)
    }


# ---- units ----------------------------------------------------------------------------------


def test_ring_blocks_bounds_every_step_exactly():
    """R covers the live slots of every step (window behind the first query + the new
    positions), and is reached: no step needs more, some step needs all of it."""
    for window, block in ((16, 8), (8, 8), (128, 64), (10, 3)):
        spec = CacheGroupSpec("w", (0,), block, 1, window, 4, 2)
        for max_step in (1, 4, 17, 40):
            live = [
                (length + n - 1) // block - spec.first_live_slot(length) + 1
                for length in range(200)
                for n in range(1, max_step + 1)
            ]
            assert max(live) == spec.ring_blocks(max_step), (window, block, max_step)
    with pytest.raises(ValueError, match="max_step_tokens"):
        spec.ring_blocks(0)


def test_block_tables_ring_writes_and_replay():
    """Appends land in column slot % R; a delta longer than the ring writes its last R
    slots only; the drained writes (unique indices) replayed on a zero buffer rebuild the
    host tables, also when one row is appended twice between drains."""
    tables = BlockTables({"swa": 4, "kv": 8}, max_num_reqs=2, max_len=64, ring_widths={"swa": 3})
    assert tables.num_cols == [3, 9] and tables.is_ring == [True, False]
    flat = np.zeros(int(tables.flat_offsets[-1]), dtype=np.int64)

    def replay() -> None:
        index, values = tables.drain_writes()
        assert len(np.unique(index)) == len(index)
        flat[index] = values
        for g, name in enumerate(tables.names):
            view = flat[tables.flat_offsets[g] : tables.flat_offsets[g + 1]].reshape(3, -1)
            assert (view[:2] == tables.tables[name].numpy()).all(), name
            assert not view[2].any()  # the null row stays null

    tables.add("a", ([0, 0, 11, 12, 13], [5, 6]))  # slots 0..4: 0, 1 left the window
    assert tables.tables["swa"][0].tolist() == [12, 13, 11]  # slots 3, 4, 2
    replay()
    tables.append("a", ([14], []))  # slot 5 -> column 2
    tables.append("a", ([15, 16], [7]))  # the same row again before a drain
    assert tables.tables["swa"][0].tolist() == [15, 16, 14]  # slots 6, 7, 5
    assert tables.lengths["swa"][0] == 8 and tables.tables["kv"][0, :3].tolist() == [5, 6, 7]
    replay()
    with pytest.raises(ValueError, match="unknown groups"):
        BlockTables({"swa": 4}, 2, 64, ring_widths={"nope": 3})


def test_sliding_tables_do_not_grow_with_max_model_len():
    """V4-Flash, 2048-token steps: the sliding groups' width is R at max_model_len 4096 and
    65536 alike; the full-history groups grow. And the device tables' bytes at max_model_len
    1M (256 requests, 8192-token steps), linear vs ring, printed for the record."""
    groups = cache_groups_for(v4_flash_config())
    block_tokens = {g.name: g.block_tokens for g in groups}
    rings = ring_widths(groups, 2048)
    assert rings == {g.name: g.ring_blocks(2048) for g in groups if g.is_sliding}
    assert {"swa": 35, "csa_state": 258}.items() <= rings.items()
    small = BlockTables(block_tokens, 2, 4096, rings)
    large = BlockTables(block_tokens, 2, 65536, rings)
    for g, spec in enumerate(groups):
        if spec.is_sliding:
            assert small.num_cols[g] == large.num_cols[g] == rings[spec.name]
            assert large.tables[spec.name].shape[1] == rings[spec.name]
        else:
            assert large.num_cols[g] > small.num_cols[g]
    rings = ring_widths(groups, 8192)
    assert {"swa": 131, "csa_state": 1026}.items() <= rings.items()

    def table_bytes(max_len: int, with_rings: bool) -> int:
        widths = table_widths(block_tokens, max_len, rings if with_rings else None)
        return sum((256 + 1) * cols * 8 for cols, _ in widths)

    linear, ring = table_bytes(1 << 20, False), table_bytes(1 << 20, True)
    print(f"\nv4-flash device block tables at 1M, 256 requests: linear {linear / 1e6:.1f} MB, "
          f"rings {ring / 1e6:.1f} MB")  # fmt: skip
    assert ring < linear / 10


# ---- engines: ring vs linear tables ----------------------------------------------------------


def _engine(
    model_dir: Path,
    max_model_len: int = 512,
    kv_tokens: int | None = None,
    max_num_seqs: int = 8,
    speculative: SpecConfig | None = None,
) -> EngineCore:
    cfg = ModelConfig.from_pretrained(model_dir)
    kv = None
    if kv_tokens is not None:  # sliding minimum + full-history groups for ~kv_tokens
        groups = cache_groups_for(cfg, dtype_bytes=4)
        minimum = plan_num_blocks(groups, 1 << 40, max_num_seqs, MAX_STEP)
        full = [g for g in groups if not g.is_sliding]
        kv = int(
            sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
            + sum(2 * g.bytes_per_block + kv_tokens * g.bytes_per_token for g in full)
        )
    config = EngineConfig(
        model=str(model_dir),
        model_config=cfg,
        cache=CacheConfig(kv_cache_memory=kv),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_STEP, max_model_len=max_model_len
        ),
        device="cpu",
        speculative=speculative,
    )
    return EngineCore(config, log_stats=False)


def _record_logits(core: EngineCore) -> list[torch.Tensor]:
    """Every compute_logits output of the core's model (target and MTP drafts), in order."""
    model, calls = core.runner.model, []
    compute = model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        calls.append(out.detach().clone())
        return out

    model.compute_logits = recorded
    return calls


def _run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    outputs: dict[str, list[int]] = {req_id: [] for req_id in prompts}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            outputs[out.request_id] += out.new_token_ids
    return outputs


def _ring_vs_linear(
    monkeypatch, make: Callable[[], EngineCore], drive: Callable[[EngineCore], object]
) -> tuple[EngineCore, object]:
    """Run ``drive`` on a ring-table engine and on a linear-table one; assert their logits
    are bitwise equal and their outputs the same; returns the ring engine and its result."""
    results = []
    for linear in (False, True):
        with monkeypatch.context() as patch:
            if linear:
                patch.setattr(CacheGroupSpec, "ring_blocks", lambda self, n: 1 << 30)
            core = make()
        tables = core.runner.input_batch.block_tables
        swa = tables.names.index("swa")
        assert tables.is_ring[swa] != linear  # the ring engine really wraps its tables
        logits = _record_logits(core)
        results.append((core, drive(core), logits))
    (ring_core, ring_out, ring_logits), (_, linear_out, linear_logits) = results
    assert ring_out == linear_out
    assert len(ring_logits) == len(linear_logits) > 0
    for a, b in zip(ring_logits, linear_logits, strict=True):
        assert torch.equal(a, b)
    return ring_core, ring_out


def test_long_generation_and_wide_chunks_equal_linear(tiny, monkeypatch):
    """Prompts chunked 40 tokens a step (window 16) and generations wrapping the 8-column
    swa ring several times (up to 330 tokens = 41 slots): logits equal linear tables'."""
    prompts = _prompts([130, 57, 3])
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    core, out = _ring_vs_linear(
        monkeypatch, lambda: _engine(tiny), lambda c: _run(c, prompts, params)
    )
    tables = core.runner.input_batch.block_tables
    assert tables.num_cols[tables.names.index("swa")] == 8
    assert all(len(o) == 200 for o in out.values())


def test_prefix_hits_and_preemption_equal_linear(tiny, monkeypatch):
    """Turn 2 of each session (prompt + output + new text) hits the finish checkpoints of
    turn 1 at 32-token boundaries; a KV budget of ~600 tokens for 6 long requests forces
    preemptions, resumed through prefix hits. Logits equal linear tables'."""
    turn1 = _prompts([70, 45, 90, 33, 64, 100], seed=2)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    extra = _prompts([20] * 6, seed=3)

    def drive(core: EngineCore) -> object:
        out1 = _run(core, turn1, params)
        turn2 = {f"{k}b": turn1[k] + out1[k] + extra[k] for k in turn1}
        out2 = _run(core, turn2, params)
        stats = core.scheduler.kv.stats
        return out1, out2, stats.num_hit_tokens, core.scheduler.num_preemptions

    _, (_, _, num_hit, num_preempted) = _ring_vs_linear(
        monkeypatch, lambda: _engine(tiny, kv_tokens=600), drive
    )
    assert num_hit > 0 and num_preempted > 0


def test_mtp_spec_decode_equals_linear(tiny, monkeypatch):
    """MTP K=3: verify steps of 4 tokens plus drafts written 3 positions ahead (the ring
    is sized with the lookahead); target and draft logits equal linear tables'."""
    prompts = _prompts([50, 23], seed=4)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    spec = SpecConfig(method="mtp", num_speculative_tokens=3)
    core, _ = _ring_vs_linear(
        monkeypatch, lambda: _engine(tiny, speculative=spec), lambda c: _run(c, prompts, params)
    )
    assert core.scheduler.spec_stats is not None and core.scheduler.spec_stats.num_drafts > 0
