"""End to end on the tiny model: the engine's greedy tokens equal transformers' generate."""

from __future__ import annotations

import pytest
import torch

from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams

from engine_utils import make_engine, run_to_completion
from hf_reference import hf_reference

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(model dir, prompts, transformers' greedy continuation of each prompt alone)."""
    cfg = tiny_config(vocab_size=1024)
    path = tmp_path_factory.mktemp("tiny_hf")
    hf = hf_reference(cfg, path, seed=11)
    g = torch.Generator().manual_seed(12)
    shared = torch.randint(2, cfg.vocab_size, (100,), generator=g).tolist()
    prompts = {}
    for i in range(32):
        n = int(torch.randint(5, 301, (1,), generator=g))
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()
        prompts[f"r{i}"] = shared + ids if i % 3 == 0 else ids  # 5 .. 400 tokens
    expected = {}
    with torch.no_grad():
        for req_id, ids in prompts.items():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected[req_id] = out[0, len(ids) :].tolist()
    return path, prompts, expected


def test_concurrent_mixed_lengths_match_transformers(reference):
    path, prompts, expected = reference
    assert min(map(len, prompts.values())) >= 5 and max(map(len, prompts.values())) <= 400
    core = make_engine(path, max_num_batched_tokens=512)  # forces chunked prefills
    assert run_to_completion(core, prompts, GREEDY) == expected
    stats = core.scheduler.stats()
    assert stats.prefix_cache_hits > 0  # the shared 100-token prefix: 96 aligned tokens
    assert core.scheduler.kv.usage == 0.0  # every block back once all finished


def test_preemption_changes_no_output(reference):
    path, prompts, expected = reference
    core = make_engine(path, max_num_batched_tokens=512, kv_tokens=2500)
    assert run_to_completion(core, prompts, GREEDY) == expected
    assert core.scheduler.num_preemptions > 0


def test_prefix_hits_change_no_output(reference):
    """Serve the shared-prefix prompts one after another. The first computes the shared
    prefix, the second diverges from it and checkpoints the divergence point, every later
    one hits there (96 = floor_32(100) tokens)."""
    path, prompts, expected = reference
    core = make_engine(path)
    shared = {k: v for k, v in prompts.items() if int(k[1:]) % 3 == 0}
    for req_id, ids in shared.items():
        assert run_to_completion(core, {req_id: ids}, GREEDY) == {req_id: expected[req_id]}
    stats = core.scheduler.stats()
    assert stats.prefix_cache_hits == 96 * (len(shared) - 2)
