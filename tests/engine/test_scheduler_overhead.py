"""The per-step fast paths keep the contract: the batched CachedRequestData (None when no
group got a block), the runner's block tables built from it, the chunk-at-a-time hash chain."""

from __future__ import annotations

import pytest

from rackserve.config import SchedulerConfig
from rackserve.engine.outputs import RunnerOutput
from rackserve.engine.scheduler import Scheduler
from rackserve.kv.hashing import BlockHashChain, hash_tokens
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.spec import cache_groups_for
from rackserve.model.presets import preset_config
from rackserve.request import Request, SamplingParams
from rackserve.runner.input_batch import InputBatch


def test_batched_cached_data_matches_the_manager_tables():
    """Decode V4-Flash groups (8-token csa_state blocks) through scheduler and InputBatch:
    every step's parallel lists line up, a None entry means the manager added no block,
    and the runner's tables stay equal to the manager's."""
    cfg = preset_config("v4-flash", num_layers=4, num_experts=8)
    groups = cache_groups_for(cfg)
    kv = KVCacheManager(groups, {g.name: 400 for g in groups})
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=400)
    sched = Scheduler(config, kv, cfg.eos_token_id)
    batch = InputBatch(
        {g.name: g.block_tokens for g in groups}, 4, 400, cfg.vocab_size, cfg.eos_token_id, "cpu"
    )
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(3):
        prompt = [(i * 31 + t) % 500 + 2 for t in range(100 + 7 * i)]
        sched.add_request(Request(f"r{i}", prompt, params, cfg.eos_token_id, arrival_time=0.0))
    num_none = num_blocks = 0
    while sched.num_unfinished:
        before = {r.request_id: kv.get_block_ids(r) for r in sched.running}
        out = sched.schedule()
        cached = out.cached_reqs
        assert len(cached.new_block_ids) == len(cached.num_computed_tokens) == cached.num_reqs
        for req_id, new, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            req = sched.requests[req_id]
            assert computed + out.num_scheduled_tokens[req_id] == req.num_computed_tokens
            grew = kv.get_block_ids(req) != before[req_id]
            assert (new is not None) == grew
            num_none += new is None
            num_blocks += new is not None
        step = batch.prepare(out)
        assert step is not None
        # reused from the last step when the same requests run: still this step's
        ids = [n.req_id for n in out.new_reqs] + cached.req_ids
        assert [r.req_id for r in step.reqs] == ids
        assert step.inputs.rows == [batch.block_tables.row_of[i] for i in ids]
        assert step.inputs.positions.tolist()[-1] == sched.requests[ids[-1]].num_computed_tokens - 1
        for req in sched.running:
            row = batch.block_tables.row_of[req.request_id]
            for g, ids in enumerate(kv.get_block_ids(req)):
                table = batch.block_tables.tables[groups[g].name][row, : len(ids)].tolist()
                # slots the manager released (null block 0) are never read again
                assert [b if m else 0 for b, m in zip(table, ids, strict=True)] == ids
                assert batch.block_tables.lengths[groups[g].name][row] == len(ids)
        sampled = [[7] if s else [] for s in step.inputs.sample_mask]
        for r, tokens in zip(step.reqs, sampled, strict=True):
            r.token_ids.extend(tokens)
        sched.update(out, RunnerOutput([r.req_id for r in step.reqs], sampled))
    assert num_none > num_blocks > 0  # most decode steps add no block, some do


@pytest.mark.parametrize("algo", ["xxhash", "sha256"])
@pytest.mark.parametrize("granularity", [1, 8, 64])
def test_chain_extend_equals_hash_tokens(algo: str, granularity: int):
    tokens = [(t * 7919) % 100_000 for t in range(300)]
    chain = BlockHashChain(granularity, "salt", algo)
    for end in (5, 64, 65, 300):  # grown in uneven steps, as decode and prefill do
        chain.extend(tokens[:end])
    parent, expected = chain.root, []
    for i in range(len(tokens) // granularity):
        chunk = tokens[i * granularity : (i + 1) * granularity]
        parent = hash_tokens(parent, chunk, algo=algo)
        expected.append(parent)
    assert chain.hashes == expected
