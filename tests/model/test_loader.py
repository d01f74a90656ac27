"""Checkpoint loading: round trip, accepted spellings, and errors that name the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rackserve.cli import main
from rackserve.config import ConfigError, ModelConfig
from rackserve.model.create import create_checkpoint
from rackserve.model.loader import CheckpointError, checkpoint_weight_bytes, load_model
from rackserve.model.presets import tiny_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    cfg = tiny_config(num_layers=3, vocab_size=512)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("tiny"), seed=3)


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loads_every_tensor_and_mtp(tiny_dir: Path):
    model = load_model(tiny_dir)
    assert model.has_mtp
    state = load_file(str(tiny_dir / "model.safetensors"))
    w1 = state["model.layers.1.ffn.experts.3.w1.weight"]
    assert torch.equal(model.model.layers[1].ffn.experts.w13[3, : w1.shape[0]], w1)
    assert torch.equal(model.head.weight, state["head.weight"])


def model_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers as held (a tensor shared by several modules once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_weight_bytes_from_the_headers(tiny_dir: Path, dtype: torch.dtype):
    """What the KV budget keeps for a draft model before loading it: the loaded model's
    bytes, the reference's float32 parameters included (the model's few buffers are not)."""
    held = model_bytes(load_model(tiny_dir, dtype=dtype))
    estimate = checkpoint_weight_bytes(tiny_dir, dtype)
    assert abs(estimate - held) <= 0.001 * held, (estimate, held)


def test_sharded_checkpoint_and_original_spelling(tiny_dir: Path, tmp_path: Path):
    state = load_file(str(tiny_dir / "model.safetensors"))
    renamed = {}
    for name, t in state.items():  # DeepSeek's own spelling: no `model.` prefix
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        name = name.replace("hc_head.hc_", "hc_head_") if name.startswith("hc_head.") else name
        renamed[name] = t
    names = sorted(renamed)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(tiny_dir / "config.json", out)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: renamed[n] for n in part}, str(out / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(tiny_dir), load_model(out)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_bf16_keeps_reference_fp32_params(tiny_dir: Path):
    model = load_model(tiny_dir, dtype=torch.bfloat16)
    assert model.head.weight.dtype == torch.bfloat16
    layer = model.model.layers[1]
    assert layer.attn.attn_sink.dtype == torch.float32
    assert layer.hc_attn_fn.dtype == torch.float32
    assert layer.attn_norm.weight.dtype == torch.float32
    # every value is the checkpoint's, rounded once: as an fp32 load cast afterwards
    fp32 = load_model(tiny_dir).cast(torch.bfloat16)
    for (name, got), (_, want) in zip(
        model.state_dict().items(), fp32.state_dict().items(), strict=True
    ):
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_bf16_model_is_never_held_in_fp32(tiny_dir: Path, monkeypatch):
    """The loader makes each parameter in the model dtype as it is registered, so no fp32
    copy of the model exists at once (a 30 GB bf16 checkpoint took 60 GiB of the GPU)."""
    made: list[torch.dtype] = []
    register = torch.nn.Module.register_parameter

    def spy(module, name, param):
        register(module, name, param)
        if param is not None:
            made.append(getattr(module, name).dtype)

    monkeypatch.setattr(torch.nn.Module, "register_parameter", spy)
    load_model(tiny_dir, dtype=torch.bfloat16)
    assert made and set(made) == {torch.bfloat16}  # fp32 ones go back to fp32 in cast
    assert torch.nn.Module.register_parameter is spy  # the loader's hook is gone again
    assert torch.nn.Linear(4, 4).weight.dtype == torch.float32


def _rewrite(path: Path, edit) -> None:
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def test_missing_tensor(tiny_dir: Path, tmp_path: Path):
    d = copy_of(tiny_dir, tmp_path / "c")
    _rewrite(d, lambda s: s.pop("model.layers.0.attn.wq_a.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['model.layers.0.attn.wq_a"):
        load_model(d)


def test_missing_expert(tiny_dir: Path, tmp_path: Path):
    d = copy_of(tiny_dir, tmp_path / "c")
    _rewrite(d, lambda s: s.pop("model.layers.2.ffn.experts.5.w2.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers.2.ffn.experts.w2"):
        load_model(d)


def test_unexpected_tensor(tiny_dir: Path, tmp_path: Path):
    d = copy_of(tiny_dir, tmp_path / "c")
    _rewrite(d, lambda s: s.update({"model.layers.0.attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*attn.extra"):
        load_model(d)


def test_shape_mismatch(tiny_dir: Path, tmp_path: Path):
    d = copy_of(tiny_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape mismatches.*config.json"):
        load_model(d)


def test_unknown_model_type(tiny_dir: Path, tmp_path: Path):
    d = copy_of(tiny_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_model(d)


def test_unreadable_files(tiny_dir: Path, tmp_path: Path):
    d = copy_of(tiny_dir, tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        load_model(d)
    (d / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(d)


def test_cli_error_is_one_line(tmp_path: Path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "config.json not found" in err and "model create" in err
    assert "Traceback" not in err


def test_legacy_config_keys():
    raw = tiny_config(num_layers=4).to_hf_dict()
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor"):
        raw.pop(key)
    compress = raw.pop("rope_parameters")["compress"]
    raw.update(
        compress_ratios=[0, 4, 128, 4],
        compress_rate_hca=16,
        num_hash_layers=2,
        qk_rope_head_dim=16,
        rope_scaling={k: v for k, v in compress.items() if k not in ("rope_theta",)},
    )
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types[:3] == tiny_config(num_layers=4).layer_types[:3]
    assert cfg.hca_ratio == 16 and cfg.num_hash_layers == 2 and cfg.qk_rope_head_dim == 16
    assert cfg.rope_compress == tiny_config().rope_compress


def test_mtp_layer_runs_over_the_paged_cache(tiny_dir: Path):
    """MTP (transformers has no reference for it): predicts t+2 from the final streams at t
    and token t+1, over its own sliding-window cache layer; shapes and finiteness."""
    from rackserve.model.generate import ContiguousCache

    model = load_model(tiny_dir)
    ids = torch.randint(2, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    cache = ContiguousCache(model, 1, 41)
    assert model.cfg.num_hidden_layers in cache.tensors.tensors["swa"]  # the MTP layer's cache
    with torch.inference_mode():
        hidden, streams = model(ids[:-1], cache.batch([0], [39], [0]), cache.tensors)
        # MTP input at position t: streams at t and token t+1, positions shifted by one
        batch = cache.batch([1], [39], [0])
        mtp_hidden, _ = model.mtp_forward(0, ids[1:], streams, batch, cache.tensors)
        logits = model.compute_logits(mtp_hidden)
        main_logits = model.compute_logits(hidden)
    assert hidden.shape == mtp_hidden.shape == (39, model.cfg.hidden_size)
    assert logits.shape == (39, model.cfg.vocab_size) and torch.isfinite(logits).all()
    assert not torch.allclose(logits, main_logits)
    # the MTP head on the drafting rows only (head_rows): those rows, the same streams
    rows = torch.tensor([3, 38])
    with torch.inference_mode():
        again = ContiguousCache(model, 1, 41)
        model(ids[:-1], again.batch([0], [39], [0]), again.tensors)
        some, x = model.mtp_forward(0, ids[1:], streams, batch, again.tensors, head_rows=rows)
        none, _ = model.mtp_forward(0, ids[1:], streams, batch, again.tensors, rows[:0])
    assert some.shape == (2, model.cfg.hidden_size) and none.shape == (0, model.cfg.hidden_size)
    torch.testing.assert_close(some, mtp_hidden[rows], rtol=1e-6, atol=1e-6)
    assert x.shape == streams.shape
