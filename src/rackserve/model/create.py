"""Create a random-weight DeepSeek-V4 checkpoint in the ``save_pretrained`` format.

Tensors are generated one at a time (each from its own generator seeded by the run seed
and the tensor name, so the bytes do not depend on order) and written in shards, so a
``v4-flash`` shape with many experts never needs the whole model in memory.

Initialisation keeps activations in a sane range through all layers: projections are
N(0, 1/fan_in), residual-branch outputs are further scaled by 1/sqrt(2 * layers), norm
weights are 1, mHC starts near the identity mix, and the hash-MoE table gives every token
distinct experts.

With ``cfg.quantization`` the same values are stored quantized, as DeepSeek-V4-Flash ships:
the linears of ``fp8_linear_names`` in FP8 with 128x128 block scales (``weight_scale_inv``),
routed experts in FP4 (packed int8 + one scale per 32 inputs) or FP8; scales as ue8m0
(``float8_e8m0fnu``) or float32 (``scale_fmt``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from rackserve.config import ModelConfig
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.layers import FP32_PARAM_SUFFIXES
from rackserve.model.quant import fp8_linear_names, quantize_linears_
from rackserve.model.tokenizer import write_tokenizer
from rackserve.ops.quant import FP8_DTYPE, quantize_fp4, quantize_fp8, stored_scale

SHARD_BYTES = 2 << 30
# stacked experts are `experts.w2` in the model, `experts.{e}.w2.weight` in checkpoints
_RESIDUAL_OUT = ("attn.wo_b.weight", ".w2.weight", "experts.w2", "eh_proj.weight")


_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def checkpoint_shapes(cfg: ModelConfig, with_mtp: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the checkpoint, experts written one by one, as
    full-precision values (``quantized_entries`` turns one into its stored tensors)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(dataclasses.replace(cfg, quantization=None), with_mtp)
    out: list[tuple[str, tuple[int, ...]]] = []
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n.endswith("tid2eid")]
    for name, t in tensors:
        if name.endswith("experts.w13"):
            prefix = name.removesuffix(".w13")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out.append((f"{prefix}.{e}.w1.weight", (inter, t.shape[2])))
                out.append((f"{prefix}.{e}.w3.weight", (inter, t.shape[2])))
        elif name.endswith("experts.w2"):
            prefix = name.removesuffix(".w2")
            out.extend((f"{prefix}.{e}.w2.weight", tuple(t.shape[1:])) for e in range(t.shape[0]))
        else:
            out.append((name, tuple(t.shape)))
    return sorted(out)


def init_rule(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[str, float]:
    """How one weight starts: ("fill", value) or ("normal", std). The one set of rules for
    checkpoints (``init_tensor``) and in-place device init (``init_model_``)."""
    if name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale", "hc_scale")):
        return "fill", 1.0
    if name.endswith(("hc_attn_base", "hc_ffn_base", "hc_base", "gate.bias")):
        return "fill", 0.0
    if name.endswith(("hc_attn_fn", "hc_ffn_fn", "hc_fn")):
        return "normal", 0.02
    if name.endswith(("ape", "attn_sink")):
        return "normal", 0.1
    if name.endswith("embed_tokens.weight"):
        return "normal", 1.0
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(_RESIDUAL_OUT):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return "normal", std


def init_tensor(
    name: str,
    shape: tuple[int, ...],
    cfg: ModelConfig,
    seed: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A deterministic random tensor for one checkpoint entry, drawn on ``device`` (a GPU
    draws other values than the CPU, as reproducibly) and returned on the CPU."""
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("tid2eid"):
        # distinct experts per token: the first k of a random permutation
        scores = torch.rand(shape[0], cfg.n_routed_experts, generator=g, device=device)
        return scores.argsort(dim=-1)[:, : shape[1]].to(torch.int64).contiguous().cpu()
    kind, value = init_rule(name, shape, cfg)
    if kind == "fill":
        return torch.full(shape, value, dtype=torch.float32)
    t = torch.randn(shape, generator=g, device=device) * value
    # the reference's float32 parameters stay float32 in the checkpoint
    return (t if name.endswith(FP32_PARAM_SUFFIXES) else t.to(dtype)).cpu()


def fp8_weight_names(cfg: ModelConfig, with_mtp: bool = True) -> set[str]:
    """The ``.weight`` names a quantized checkpoint stores in FP8 (``fp8_linear_names``)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(dataclasses.replace(cfg, quantization=None), with_mtp)
    return {f"{name}.weight" for name in fp8_linear_names(model)}


def quantized_entries(
    name: str, t: torch.Tensor, cfg: ModelConfig, fp8_weights: set[str]
) -> dict[str, torch.Tensor]:
    """One full-precision tensor -> the checkpoint tensors that store it (itself when it
    stays unquantized): ``weight`` + ``weight_scale_inv`` for FP8 linears and experts."""
    q = cfg.quantization
    if q is None:
        return {name: t}
    ue8m0 = q.scale_fmt == "ue8m0"
    scale_dtype = torch.float8_e8m0fnu if ue8m0 else torch.float32

    def scale(s: torch.Tensor) -> torch.Tensor:
        return stored_scale(s, torch.uint8).view(scale_dtype) if ue8m0 else s

    if _EXPERT_WEIGHT.search(name) and q.expert_dtype == "fp4":
        packed, s = quantize_fp4(t, ue8m0)
        return {name: packed.view(torch.int8), name + "_scale_inv": scale(s)}
    if _EXPERT_WEIGHT.search(name) or name in fp8_weights:
        w, s = quantize_fp8(t, ue8m0)
        return {name: w, name + "_scale_inv": scale(s)}
    return {name: t}


def _shards(
    shapes: list[tuple[str, tuple[int, ...]]],
    cfg: ModelConfig,
    seed: int,
    dtype: torch.dtype,
    fp8_weights: set[str],
    device: torch.device | str,
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, shape in shapes:
        entries = quantized_entries(
            name, init_tensor(name, shape, cfg, seed, dtype, device), cfg, fp8_weights
        )
        nbytes = sum(t.numel() * t.element_size() for t in entries.values())
        if shard and size + nbytes > SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard.update(entries)
        size += nbytes
    if shard:
        yield shard


def create_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_mtp: bool = True,
    device: torch.device | str = "cpu",
) -> Path:
    """Write config.json, safetensors shards (+ index when sharded) and the tokenizer.
    ``device``: where the weights are drawn (a GPU: other values than the CPU's; the
    v4-flash preset's CPU draw took 70-90 s on the device machine, 2026-12-07)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = checkpoint_shapes(cfg, with_mtp)
    fp8_weights = fp8_weight_names(cfg, with_mtp) if cfg.quantization else set()
    files: list[tuple[str, list[str]]] = []
    for i, shard in enumerate(_shards(shapes, cfg, seed, dtype, fp8_weights, device)):
        fname = f"model-{i + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        files.append((fname, list(shard)))
    if len(files) == 1:
        (out / files[0][0]).rename(out / "model.safetensors")
    else:
        total = len(files)
        weight_map = {}
        for i, (fname, names) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (out / fname).rename(out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = cfg.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # Real vocabularies (129K) are larger than our corpus can train; the model keeps its
    # vocab size and the tokenizer uses the first ids.
    write_tokenizer(out, min(cfg.vocab_size, 4096))
    return out


@torch.no_grad()
def init_model_(model: DeepseekV4ForCausalLM, seed: int = 0) -> DeepseekV4ForCausalLM:
    """Random weights in place, on the model's device (benchmarks without a checkpoint).

    The rules of ``init_rule`` drawn on the device, so a V4-Flash-sized model is ready in
    seconds; the values differ from a created checkpoint's.
    """
    cfg = model.cfg
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    if cfg.quantization is not None and not any(p.dtype == FP8_DTYPE for p in model.parameters()):
        quantize_linears_(model, fp8_linear_names(model), model.kernels)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue  # written with their weight
        if p.dtype in (FP8_DTYPE, torch.uint8):
            _init_quantized_(name, p, params, cfg, g)
            continue
        kind, value = init_rule(name, tuple(p.shape), cfg)
        if kind == "fill":
            p.fill_(value)
        else:
            p.normal_(0.0, value, generator=g)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            scores = torch.rand(b.shape[0], cfg.n_routed_experts, generator=g, device=device)
            b.copy_(scores.argsort(dim=-1)[:, : b.shape[1]])
    return model


def _init_quantized_(
    name: str,
    p: torch.Tensor,
    params: dict[str, torch.Tensor],
    cfg: ModelConfig,
    g: torch.Generator,
) -> None:
    """Random values drawn in full precision and quantized on the device, one expert at a
    time (a V4-Flash layer's experts never exist in bf16 at once)."""
    if p.dtype == FP8_DTYPE:  # an Fp8Linear's weight [N, K]
        _, std = init_rule(name, tuple(p.shape), cfg)
        w = torch.empty(p.shape, device=p.device).normal_(0.0, std, generator=g)
        q, s = quantize_fp8(w)
        p.copy_(q)
        params[name + "_scale_inv"].copy_(s)
        return
    scale = params[name + "_scale"]  # FP4 experts: p [S, N, K / 2]
    _, std = init_rule(name, (p.shape[1], 2 * p.shape[2]), cfg)
    for slot in range(p.shape[0]):
        w = torch.empty(p.shape[1], 2 * p.shape[2], device=p.device).normal_(0.0, std, generator=g)
        packed, s = quantize_fp4(w, ue8m0=scale.dtype == torch.uint8)
        p[slot].copy_(packed)
        scale[slot].copy_(stored_scale(s, scale.dtype))
