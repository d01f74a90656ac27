"""EP state per model: the MTP layers' experts are sharded over the EP group like the decoder
layers' (their own "mtp" EP model) and give one rank's outputs; a draft model with a
different expert count is balanced on its own, leaving the target's placement and loads
alone (2 gloo processes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rackserve.config import (
    EngineConfig,
    EPLBConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rackserve.model.create import create_checkpoint
from rackserve.model.generate import ContiguousCache
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config
from rackserve.moe.ep import ExpertParallel, ExpertParallelModels, expert_parallel_models
from rackserve.parallel.groups import ParallelGroups
from rackserve.parallel.launch import run_ranks

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = tiny_config(num_layers=2, num_experts=NUM_EXPERTS, vocab_size=512)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("mtp_ep"), seed=4, with_mtp=True)


def _logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Main and MTP logits [T, V] of a fixed 24-token sequence (the loader test's set-up)."""
    ids = torch.randint(2, 512, (24,), generator=torch.Generator().manual_seed(0))
    cache = ContiguousCache(model, 1, 25)
    with torch.inference_mode():
        hidden, streams = model(ids[:-1], cache.batch([0], [23], [0]), cache.tensors)
        mtp_hidden, _ = model.mtp_forward(
            0, ids[1:], streams, cache.batch([1], [23], [0]), cache.tensors
        )
        return model.compute_logits(hidden), model.compute_logits(mtp_hidden)


def mtp_worker(groups: ParallelGroups, model_dir: str) -> dict:
    parallel = ParallelConfig(data_parallel_size=groups.world_size, enable_expert_parallel=True)
    config = EngineConfig(
        model=model_dir,
        model_config=ModelConfig.from_pretrained(model_dir),
        scheduler=SchedulerConfig(max_model_len=256),
        parallel=parallel,
    )
    models = expert_parallel_models(config, groups, "cpu")
    model = load_model(model_dir, expert_parallel=models["main"], mtp_expert_parallel=models["mtp"])
    main, mtp = _logits(model)
    mtp_ep = models["mtp"]
    return {
        "names": sorted(models.models),
        "main": main.numpy(),  # numpy: a tensor crosses processes by a shared fd
        "mtp": mtp.numpy(),
        "mtp_local_experts": model.mtp[0].block.ffn.experts.w13.shape[0],
        "mtp_slots": mtp_ep.local_experts(0),
        "mtp_first_layer": mtp_ep.first_layer,
        "mtp_loads": int(mtp_ep.recorder.logical.sum()),  # recorded by the MTP forward
        "main_loads": int(models["main"].recorder.logical.sum()),
    }


def test_mtp_experts_are_sharded_and_equal_one_rank(model_dir):
    reference = _logits(load_model(model_dir))
    results = run_ranks(mtp_worker, 2, str(model_dir))
    for rank, r in enumerate(results):
        assert r["names"] == ["main", "mtp"]
        assert r["mtp_local_experts"] == NUM_EXPERTS // 2  # half the MTP experts per rank
        assert r["mtp_slots"] == list(range(4 * rank, 4 * rank + 4))
        assert r["mtp_first_layer"] == 2  # MTP layer 0 is the model's layer 2
        main, mtp = torch.from_numpy(r["main"]), torch.from_numpy(r["mtp"])
        torch.testing.assert_close(main, reference[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mtp, reference[1], rtol=1e-5, atol=1e-5)
        # each model counted its own layers' routing only: 23 tokens x top-k per layer
        top_k = tiny_config().num_experts_per_tok
        assert r["mtp_loads"] == 23 * top_k
        assert r["main_loads"] == 2 * 23 * top_k


def draft_worker(groups: ParallelGroups) -> dict:
    """A target (8 experts, 2 layers) and a draft (4 experts, 1 layer): skewed loads on the
    draft only, rebalance the draft, and see the target untouched."""
    eplb = EPLBConfig(window_size=4, step_interval=10_000)
    target = ExpertParallel(2, 8, 8, groups, eplb=eplb)
    draft = ExpertParallel(1, 4, 4, groups, eplb=eplb, name="draft")
    models = ExpertParallelModels([target, draft])
    with pytest.raises(ValueError, match="already registered"):
        models.add(ExpertParallel(1, 4, 4, groups, name="draft"))
    for ep, width in ((target, 3), (draft, 5)):  # expert i holds rows of value i
        layers = []
        for _ in range(ep.placement.num_layers):
            slots = torch.tensor(ep.local_experts(0), dtype=torch.float32)
            w13 = slots[:, None, None].expand(-1, 2 * width, 4).clone()
            w2 = slots[:, None, None].expand(-1, 4, width).clone()
            layers.append(SimpleNamespace(experts=SimpleNamespace(w13=w13, w2=w2)))
        ep.bind(layers)
    # draft experts 0 and 1 (both on rank 0 by default) take nearly every token
    ids = torch.tensor([[0], [1]] * 20 + [[2], [3]])
    draft.recorder.record(0, ids, ids, draft.placement)
    models.end_step(("draft",))
    before = draft.balancedness()[0]
    target_before = target.placement.physical_to_logical.clone()
    draft.rebalance()
    while draft.rearranging:
        models.end_step(("draft",))
    moved = draft.moe_layers[0].experts.w13[:, 0, 0].tolist()
    return {
        "before": before,
        "draft_placement": draft.placement.physical_to_logical.tolist(),
        "draft_local": draft.local_experts(0),
        "moved_weights": moved,
        "target_unchanged": bool(torch.equal(target.placement.physical_to_logical, target_before)),
        "target_steps": target.num_steps,
        "target_loads": int(target.recorder.logical.sum()),
    }


def test_draft_model_is_balanced_on_its_own():
    results = run_ranks(draft_worker, 2)
    for r in results:
        assert r["before"][0] < 0.6  # experts 0 and 1 on one rank: skewed
        rows = r["draft_placement"][0]
        assert {rows[0], rows[1]} != {0, 1} and sorted(rows) == [0, 1, 2, 3]  # 0, 1 split
        assert r["target_unchanged"] and r["target_steps"] == 0 and r["target_loads"] == 0
    for rank, r in enumerate(results):
        assert r["moved_weights"] == [float(e) for e in r["draft_local"]]  # weights followed
        assert r["draft_local"] == r["draft_placement"][0][2 * rank : 2 * rank + 2]


def test_registry_lookups():
    groups = ParallelGroups.single()
    models = ExpertParallelModels([ExpertParallel(2, 4, 4, groups)])
    assert "main" in models and "mtp" not in models and len(models) == 1
    assert models.get("mtp") is None
    with pytest.raises(KeyError, match="no EP model 'mtp'"):
        models["mtp"]
    with pytest.raises(ValueError, match="not one of EP model 'main'"):
        models["main"].layer_index(2)
