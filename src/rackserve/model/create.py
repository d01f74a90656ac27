"""Create a random-weight DeepSeek-V4 checkpoint in the ``save_pretrained`` format.

Tensors are generated one at a time (each from its own generator seeded by the run seed
and the tensor name, so the bytes do not depend on order) and written in shards, so a
``v4-flash`` shape with many experts never needs the whole model in memory.

Initialisation keeps activations in a sane range through all layers: projections are
N(0, 1/fan_in), residual-branch outputs are further scaled by 1/sqrt(2 * layers), norm
weights are 1, mHC starts near the identity mix, and the hash-MoE table gives every token
distinct experts.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from rackserve.config import ModelConfig
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.layers import FP32_PARAM_SUFFIXES
from rackserve.model.tokenizer import write_tokenizer

SHARD_BYTES = 2 << 30
# stacked experts are `experts.w2` in the model, `experts.{e}.w2.weight` in checkpoints
_RESIDUAL_OUT = ("attn.wo_b.weight", ".w2.weight", "experts.w2", "eh_proj.weight")


def checkpoint_shapes(cfg: ModelConfig, with_mtp: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the checkpoint, experts written one by one."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=with_mtp)
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
    name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """A deterministic random tensor for one checkpoint entry."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("tid2eid"):
        # distinct experts per token: the first k of a random permutation
        perm = torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(dim=-1)
        return perm[:, : shape[1]].to(torch.int64).contiguous()
    kind, value = init_rule(name, shape, cfg)
    if kind == "fill":
        return torch.full(shape, value, dtype=torch.float32)
    t = torch.randn(shape, generator=g) * value
    # the reference's float32 parameters stay float32 in the checkpoint
    return t if name.endswith(FP32_PARAM_SUFFIXES) else t.to(dtype)


def _shards(
    shapes: list[tuple[str, tuple[int, ...]]], cfg: ModelConfig, seed: int, dtype: torch.dtype
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, shape in shapes:
        t = init_tensor(name, shape, cfg, seed, dtype)
        if shard and size + t.numel() * t.element_size() > SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += t.numel() * t.element_size()
    if shard:
        yield shard


def create_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_mtp: bool = True,
) -> Path:
    """Write config.json, safetensors shards (+ index when sharded) and the tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = checkpoint_shapes(cfg, with_mtp)
    files: list[tuple[str, list[str]]] = []
    for i, shard in enumerate(_shards(shapes, cfg, seed, dtype)):
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
    for name, p in model.named_parameters():
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
