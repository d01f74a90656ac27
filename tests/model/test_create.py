"""`model create`: determinism, sane activations, a usable tokenizer and generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rackserve.cli import main
from rackserve.model.create import checkpoint_shapes, create_checkpoint
from rackserve.model.generate import ContiguousCache
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config, v4_flash_config


def test_same_seed_same_bytes(tmp_path: Path):
    cfg = tiny_config(num_layers=3, vocab_size=512)
    a = create_checkpoint(cfg, tmp_path / "a", seed=1)
    b = create_checkpoint(cfg, tmp_path / "b", seed=1)
    c = create_checkpoint(cfg, tmp_path / "c", seed=2)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])]
)  # fmt: skip
def test_weights_drawn_on_a_device_are_reproducible(tmp_path: Path, device: str):
    """``--device``: the CPU's draws are the default's; a GPU's are its own (other values),
    the same run to run, and load like any checkpoint."""
    cfg = tiny_config(num_layers=2, vocab_size=512)
    default = create_checkpoint(cfg, tmp_path / "default", seed=1)
    a = create_checkpoint(cfg, tmp_path / "a", seed=1, device=device)
    b = create_checkpoint(cfg, tmp_path / "b", seed=1, device=device)
    weights = "model.safetensors"
    assert (a / weights).read_bytes() == (b / weights).read_bytes()
    same_as_cpu = (a / weights).read_bytes() == (default / weights).read_bytes()
    assert same_as_cpu == (device == "cpu")
    assert main(["model", "create", "--layers", "2", "--seed", "1", "--device", device,
                 "--out", str(tmp_path / "cli")]) == 0  # fmt: skip
    model = load_model(tmp_path / "cli")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_activations_stay_sane_through_depth(tmp_path: Path):
    cfg = tiny_config(num_layers=24, vocab_size=512)
    model = load_model(create_checkpoint(cfg, tmp_path, seed=0))
    ids = torch.randint(2, 512, (200,), generator=torch.Generator().manual_seed(0))
    rms = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, i, o: rms.append(o.float().pow(2).mean().sqrt()))
    cache = ContiguousCache(model, 1, 200)
    with torch.inference_mode():
        hidden, _ = model(ids, cache.batch([0], [200], [0]), cache.tensors)
        logits = model.compute_logits(hidden)
    assert all(0.3 < float(r) < 30 for r in rms), [round(float(r), 2) for r in rms]
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 10


def test_v4_flash_shapes():
    cfg = v4_flash_config(num_layers=4, num_experts=16)
    shapes = dict(checkpoint_shapes(cfg))
    assert shapes["model.layers.0.attn.wq_b.weight"] == (64 * 512, 1024)
    assert shapes["model.layers.0.attn.wo_a.weight"] == (8 * 1024, 64 * 512 // 8)
    assert shapes["model.layers.3.attn.indexer.wq_b.weight"] == (64 * 128, 1024)
    assert shapes["model.layers.2.ffn.experts.15.w1.weight"] == (2048, 4096)
    assert shapes["model.layers.0.ffn.gate.tid2eid"] == (129280, 6)
    assert "mtp.0.eh_proj.weight" in shapes


def test_cli_create_and_generate(tmp_path: Path, capsys):
    out = tmp_path / "tiny"
    assert main(["model", "create", "--preset", "tiny", "--out", str(out)]) == 0
    assert main(["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "8"]) == 0
    text = capsys.readouterr().out.strip().splitlines()[-1]
    assert text  # eight tokens of random-model text
