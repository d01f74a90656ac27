"""FP8 / FP4 checkpoints: logits and greedy tokens equal transformers' (which dequantizes a
pre-quantized checkpoint on CPU), both spellings and transformers' fused experts load to the
same model, weights stay quantized, and every bad checkpoint gives one clear line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rackserve.config import ConfigError, QuantConfig
from rackserve.model.create import create_checkpoint
from rackserve.model.generate import ContiguousCache, generate_tokens
from rackserve.model.loader import (
    CheckpointError,
    check_checkpoint,
    checkpoint_weight_bytes,
    load_model,
)
from rackserve.model.presets import tiny_config
from rackserve.model.quant import Fp8Linear
from rackserve.ops.quant import FP8_DTYPE, dequantize_fp8

TOL = 1e-4  # max |ours - reference| relative to the reference's logit scale


def quant_cfg(scale_fmt: str = "ue8m0", num_layers: int = 3):
    cfg = tiny_config(num_layers=num_layers, vocab_size=512)
    return dataclasses.replace(cfg, quantization=QuantConfig(scale_fmt=scale_fmt))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    return create_checkpoint(quant_cfg(), tmp_path_factory.mktemp("fp8"), seed=1)


@pytest.fixture(scope="module")
def model(fp8_dir):
    return load_model(fp8_dir)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = ContiguousCache(model, 1, len(ids))
    with torch.inference_mode():
        hidden, _ = model(ids, cache.batch([0], [len(ids)], [0]), cache.tensors)
        return model.compute_logits(hidden)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    state = edit(state) or state
    save_file(state, str(dst / "model.safetensors"))
    return dst


def original_spelling(state: dict) -> dict:
    """DeepSeek's names: no ``model.`` prefix, ``embed``, block scales as ``.scale``; its
    FP4 experts as float4_e2m1fn_x2 (safetensors ``F4``)."""
    out = {}
    for name, t in state.items():
        if t.dtype == torch.int8:
            t = t.view(torch.float4_e2m1fn_x2)
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        name = name.replace("hc_head.hc_", "hc_head_") if name.startswith("hc_head.") else name
        out[name.replace(".weight_scale_inv", ".scale")] = t
    return out


def test_stays_quantized_in_memory(model):
    layer = model.model.layers[1]
    assert isinstance(layer.attn.wq_a, Fp8Linear) and layer.attn.wq_a.weight.dtype == FP8_DTYPE
    assert isinstance(layer.ffn.shared_experts.w2, Fp8Linear)
    assert not isinstance(layer.attn.compressor.wkv, Fp8Linear)  # bf16 in V4-Flash
    experts = layer.ffn.experts
    assert experts.w13.dtype == torch.uint8 and experts.w13_scale.dtype == torch.uint8
    assert experts.w13.shape == (8, 128, 64) and experts.w13_scale.shape == (8, 128, 4)
    assert not any(p.dtype == torch.bfloat16 and p.dim() == 3 for p in model.parameters())


def test_weight_bytes_count_fp8_as_stored(fp8_dir, model):
    """``checkpoint_weight_bytes``: fp8 weights and their scales at their own size, the
    rest in the load dtype (fp32 here): the loaded model's bytes, but for the dense
    linears' scales (e8m0 stored, float32 held: a few hundred bytes)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    estimate = checkpoint_weight_bytes(fp8_dir, torch.float32)
    assert abs(estimate - held) <= 0.001 * held, (estimate, held)


def test_logits_and_greedy_tokens_equal_transformers(fp8_dir, model):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' FP8 loading needs it
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    ids = torch.randint(2, 512, (70,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_error(logits(model, ids), ref) <= TOL
    prompt = ids[:20]
    with torch.no_grad():
        greedy = hf.generate(
            prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 20:].tolist()
    assert generate_tokens(model, prompt.tolist(), 12) == greedy


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="the fast kernels on CPU")
def test_fast_path_loaded_under_inference_mode(fp8_dir, model):
    """Loaded inside ``torch.inference_mode()`` (as a server or a test might), the fast path
    (FP8 GEMM kernel; the compressors' bf16 projections unfused beside FP8 ones) runs and
    equals the reference path. Before the loader built the model outside inference mode,
    the compressors' ``nn.Linear`` failed: "Inference tensors do not track version counter"
    (their Parameters were born inference tensors)."""
    with torch.inference_mode():
        fast = load_model(fp8_dir, kernels="triton")
    ids = torch.randint(2, 512, (20,), generator=torch.Generator().manual_seed(5))
    assert rel_error(logits(fast, ids), logits(model, ids)) <= TOL


def test_original_spelling_equals_transformers(fp8_dir, tmp_path):
    """DeepSeek's names (``.scale``, no ``model.``); experts int8 here, as transformers
    cannot read safetensors F4 yet (its loader reshapes by the header's element count)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    def spell(state):
        out = original_spelling(state)
        fp4 = torch.float4_e2m1fn_x2
        return {k: v.view(torch.int8) if v.dtype == fp4 else v for k, v in out.items()}

    path = rewrite(fp8_dir, tmp_path / "orig", spell)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(2, 512, (50,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_error(logits(load_model(path), ids), ref) <= TOL


def test_original_spelling_and_fused_experts_load_the_same(fp8_dir, model, tmp_path):
    ids = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(3))
    expected = logits(model, ids)
    original = rewrite(fp8_dir, tmp_path / "orig", original_spelling)

    def fuse(state: dict) -> dict:  # transformers' in-memory layout: one tensor per layer
        out = {}
        for name, t in state.items():
            if not name.startswith("model.layers.") or ".experts." not in name:
                out[name] = t
        for layer in range(3):
            p = f"model.layers.{layer}.ffn.experts"
            for suffix in ("weight", "weight_scale_inv"):
                tail = "" if suffix == "weight" else "_scale_inv"
                gate_up = [
                    torch.cat([state[f"{p}.{e}.w1.{suffix}"], state[f"{p}.{e}.w3.{suffix}"]])
                    for e in range(8)
                ]
                down = [state[f"{p}.{e}.w2.{suffix}"] for e in range(8)]
                mlp = f"model.layers.{layer}.mlp.experts"
                out[f"{mlp}.gate_up_proj{tail}"] = torch.stack(gate_up)
                out[f"{mlp}.down_proj{tail}"] = torch.stack(down)
        return out

    fused = rewrite(fp8_dir, tmp_path / "fused", fuse)
    for path in (original, fused):
        check_checkpoint(path)
        assert torch.equal(logits(load_model(path), ids), expected)


def test_float_scales_and_bf16(tmp_path):
    path = create_checkpoint(quant_cfg("float", num_layers=2), tmp_path / "f", seed=4)
    state = load_file(str(path / "model.safetensors"))
    assert state["model.layers.1.attn.wq_a.weight_scale_inv"].dtype == torch.float32
    model = load_model(path)
    assert model.model.layers[1].ffn.experts.w2_scale.dtype == torch.float32
    bf16 = load_model(path, dtype=torch.bfloat16)
    assert bf16.model.layers[1].attn.wq_a.weight_scale_inv.dtype == torch.float32
    assert bf16.model.layers[1].ffn.experts.w13.dtype == torch.uint8
    assert bf16.cast(torch.bfloat16).model.layers[1].attn.wq_a.weight.dtype == FP8_DTYPE
    ids = torch.randint(2, 512, (30,), generator=torch.Generator().manual_seed(5))
    ref = logits(model, ids)
    assert rel_error(logits(bf16, ids), ref) < 0.05  # bf16 activations, same weights


def _config_edit(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "awq"}, "unsupported quant_method 'awq'"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
        ({"expert_dtype": "int4"}, "expert_dtype must be one of"),
    ],
)
def test_bad_quantization_config(fp8_dir, tmp_path, change, message):
    path = shutil.copytree(fp8_dir, tmp_path / "c")
    _config_edit(path, **change)
    with pytest.raises(ConfigError, match=message) as e:
        load_model(path)
    assert "\n" not in str(e.value)


def test_missing_scale(fp8_dir, tmp_path):
    def drop(state):
        del state["model.layers.2.attn.wq_b.weight_scale_inv"]

    path = rewrite(fp8_dir, tmp_path / "c", drop)
    for call in (load_model, check_checkpoint):
        with pytest.raises(CheckpointError, match=r"wq_b.weight is float8 but .* no scale") as e:
            call(path)
        assert "\n" not in str(e.value)


def test_missing_expert_scale(fp8_dir, tmp_path):
    def drop(state):
        del state["model.layers.1.ffn.experts.5.w3.weight_scale_inv"]

    with pytest.raises(CheckpointError, match=r"missing tensors: .*experts.w13_scale"):
        load_model(rewrite(fp8_dir, tmp_path / "c", drop))


def test_scale_grid_of_another_block_size(fp8_dir, tmp_path):
    def regrid(state):  # the scales of 64x64 blocks
        name = "model.layers.1.attn.wq_b.weight_scale_inv"
        state[name] = state[name].repeat_interleave(2, 0).repeat_interleave(2, 1)

    with pytest.raises(CheckpointError, match=r"wq_b.weight_scale_inv: scale grid .*block"):
        load_model(rewrite(fp8_dir, tmp_path / "c", regrid))


def test_fp4_experts_without_expert_dtype(fp8_dir, tmp_path):
    path = shutil.copytree(fp8_dir, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]["expert_dtype"], cfg["expert_dtype"]  # both spellings
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="expert_dtype = 'fp4'"):
        load_model(path)


def test_float_scales_where_ue8m0_is_declared(tmp_path):
    path = create_checkpoint(quant_cfg("float", num_layers=2), tmp_path / "f", seed=4)
    _config_edit(path, scale_fmt="ue8m0")
    with pytest.raises(CheckpointError, match="powers of two"):
        load_model(path)


def test_fp8_experts_are_dequantized_once_and_shards(tmp_path):
    cfg = tiny_config(num_layers=2, vocab_size=512)
    cfg = dataclasses.replace(cfg, quantization=QuantConfig(expert_dtype="fp8"))
    path = create_checkpoint(cfg, tmp_path / "e", seed=6)
    model = load_model(path)
    state = load_file(str(path / "model.safetensors"))
    w = state["model.layers.1.ffn.experts.2.w1.weight"]
    assert w.dtype == FP8_DTYPE
    experts = model.model.layers[1].ffn.experts
    assert experts.w13.dtype == torch.float32
    scale = state["model.layers.1.ffn.experts.2.w1.weight_scale_inv"]
    assert torch.equal(experts.w13[2, :64], dequantize_fp8(w, scale, torch.float32))
    # sharded, every scale in another shard than its weight: read lazily by name
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(path / "config.json", sharded)
    scales = {k for k in state if k.endswith("_scale_inv")}
    weight_map = {}
    for fname, names in (("a.safetensors", set(state) - scales), ("b.safetensors", scales)):
        save_file({k: state[k] for k in names}, str(sharded / fname))
        weight_map.update(dict.fromkeys(names, fname))
    index = {"weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.randint(2, 512, (20,), generator=torch.Generator().manual_seed(7))
    assert torch.equal(logits(load_model(sharded), ids), logits(model, ids))


def test_cli_create_and_flags(tmp_path, capsys):
    from rackserve.cli import main
    from rackserve.model.cli import quant_config

    out = tmp_path / "cli"
    args = ["model", "create", "--preset", "tiny", "--layers", "2", "--no-mtp"]
    assert main([*args, "--quantization", "fp8", "--scale-fmt", "float", "--out", str(out)]) == 0
    assert "fp8 linears, fp4 experts, float scales" in capsys.readouterr().out
    written = json.loads((out / "config.json").read_text())
    config = written["quantization_config"]
    assert config["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"
    assert written["expert_dtype"] == "fp4"  # V4's spelling too (transformers <= 5.17 reads it)
    model = load_model(out)
    assert model.model.layers[1].ffn.experts.w2_scale.dtype == torch.float32
    assert quant_config(None) is None
    with pytest.raises(ConfigError, match="need --quantization fp8"):
        quant_config("none", expert_dtype="fp4")
