"""Expert load statistics: exact counts, the sliding window, balancedness, skewed routing."""

import pytest
import torch
from torch import nn

from rackserve import ops
from rackserve.model.moe import Router
from rackserve.model.presets import tiny_config
from rackserve.moe.eplb import rebalance_experts
from rackserve.moe.placement import ExpertPlacement, choose_replicas
from rackserve.moe.skew import apply_skewed_routing, sample_topk, synthetic_trace, zipf_popularity
from rackserve.moe.stats import ExpertLoadRecorder, balancedness, routed_rank_load


def test_balancedness_values():
    loads = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert balancedness(loads).tolist() == [1.0, 0.25, 1.0]


def _record(recorder, placement, layer, ids):
    slots = choose_replicas(
        ids, placement.logical_to_physical[layer], placement.replica_count[layer]
    )
    recorder.record(layer, ids, slots, placement)


def test_counts_and_sliding_window():
    placement = ExpertPlacement.from_physical_to_logical(torch.tensor([[0, 1, 2, 0]]), 3, 2)
    recorder = ExpertLoadRecorder(1, 3, 4, window=2)
    _record(recorder, placement, 0, torch.tensor([[0, 1], [0, 2]]))  # expert 0 -> slots 0, 3
    recorder.next_step()
    assert recorder.logical_load().tolist() == [[2, 1, 1]]
    assert recorder.physical[0, 0].tolist() == [1, 1, 1, 1]
    # Ranks hold slots {0, 1} and {2, 3}: 2 and 2 tokens.
    assert recorder.step_balancedness(2).tolist() == [1.0]
    _record(recorder, placement, 0, torch.tensor([[1, 2]]))
    recorder.next_step()
    _record(recorder, placement, 0, torch.tensor([[1, 2]]))
    recorder.next_step()
    # Window of 2: the first step is forgotten.
    assert recorder.logical_load().tolist() == [[0, 2, 2]]
    assert recorder.step_balancedness(2).tolist() == [1.0]
    _record(recorder, placement, 0, torch.tensor([[1, 0]]))  # slots 1 and 0: all on rank 0
    recorder.next_step()
    assert recorder.step_balancedness(2).tolist() == [pytest.approx((1.0 + 0.5) / 2)]


def test_uniform_reference_shows_the_gap():
    num_experts, ranks = 32, 4
    trace = synthetic_trace(2, num_experts, 4, 512, exponent=1.5, seed=1)
    placement = ExpertPlacement.default(2, num_experts, ranks)
    recorder = ExpertLoadRecorder(2, num_experts, num_experts, uniform_reference=True)
    for step in range(4):
        for layer in range(2):
            _record(recorder, placement, layer, trace[layer, step * 128 : (step + 1) * 128])
        recorder.next_step()
    real = recorder.step_balancedness(ranks)
    uniform = recorder.step_balancedness(ranks, uniform=True)
    assert (real < 0.7).all() and (uniform > 0.85).all()
    # After EPLB on the window's load, the same batches are far better balanced.
    new = rebalance_experts(recorder.logical_load(), num_experts + ranks, 1, 1, ranks)
    after = [
        balancedness(routed_rank_load(trace[layer], new, layer).double()) for layer in range(2)
    ]
    assert all(b > 0.9 for b in after)
    with pytest.raises(ValueError, match="uniform reference"):
        ExpertLoadRecorder(1, 4, 4).step_balancedness(2, uniform=True)


def test_zipf_popularity_and_sampling():
    gen = torch.Generator().manual_seed(0)
    pop = zipf_popularity(3, 16, 1.0, gen)
    assert torch.allclose(pop.sum(1), torch.ones(3, dtype=torch.float64))
    assert sorted(pop[0].tolist()) == sorted(pop[1].tolist())  # same law, another ranking
    ids = sample_topk(pop[0], 4000, 3, gen)
    assert ids.shape == (4000, 3)
    assert all(len(set(row)) == 3 for row in ids[:200].tolist())  # distinct per token
    hottest = int(pop[0].argmax())
    coldest = int(pop[0].argmin())
    counts = torch.bincount(ids.flatten(), minlength=16)
    assert counts[hottest] > 4 * counts[coldest]
    uniform = sample_topk(torch.full((16,), 1 / 16, dtype=torch.float64), 4000, 3, gen)
    assert balancedness(torch.bincount(uniform.flatten(), minlength=16).double()) > 0.9
    with pytest.raises(ValueError, match="exponent"):
        zipf_popularity(1, 4, -1.0, gen)


def test_apply_skewed_routing_on_routers():
    cfg = tiny_config(num_experts=32)
    torch.manual_seed(0)
    k = ops.kernels("reference")
    routers = nn.ModuleList([Router(cfg, True, k), Router(cfg, False, k)])
    for router in routers:
        nn.init.normal_(router.weight, std=0.1)
    x = torch.randn(512, cfg.hidden_size)
    token_ids = torch.randint(0, cfg.vocab_size, (512,))
    placement = ExpertPlacement.default(2, 32, 4)
    before = balancedness(routed_rank_load(routers[1](x, token_ids)[0], placement, 1).double())
    assert apply_skewed_routing(routers, exponent=1.2, seed=0) == 2
    for layer, router in enumerate(routers):
        ids = router(x, token_ids)[0]
        after = balancedness(routed_rank_load(ids, placement, layer).double())
        assert after < 0.7
        assert after < before
