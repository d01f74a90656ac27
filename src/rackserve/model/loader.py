"""Load a Hugging Face DeepSeek-V4 checkpoint directory into our model.

Accepted: ``config.json`` + ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Tensor names as transformers' ``save_pretrained`` writes
them (``model.layers.0.attn.wq_a.weight``, ``head.weight``, per-expert
``ffn.experts.{e}.w1.weight``), and DeepSeek's original spelling without the ``model.``
prefix (``embed.weight``, ``layers.0...``, ``norm.weight``, ``hc_head_fn``).

Tensors are read one at a time straight into the model's parameters, so peak memory is
one model plus one tensor. Routed experts are stored stacked; each expert's ``w1``/``w3``
/``w2`` goes into its slice of ``w13``/``w2``. With expert parallelism a rank's ``Experts``
hold only its physical slots: an expert's tensors go into every local slot that holds it,
and experts no local slot holds are never read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from rackserve.config import ModelConfig
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.moe import Experts
from rackserve.moe.ep import ExpertParallel


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names the fix."""


_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_ORIGINAL_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def canonical_name(name: str) -> str:
    """Map any accepted spelling to the ``save_pretrained`` one."""
    if name in _ORIGINAL_TOP_LEVEL:
        return _ORIGINAL_TOP_LEVEL[name]
    if name.startswith("layers."):
        return "model." + name
    if name.startswith("mtp."):
        # MTP blocks reuse decoder-layer names under `mtp.{k}.block.`
        parts = name.split(".", 2)
        rest = parts[2] if len(parts) > 2 else ""
        if rest.startswith(("attn.", "ffn.", "attn_norm", "ffn_norm", "hc_attn", "hc_ffn")):
            return f"mtp.{parts[1]}.block.{rest}"
        if rest.startswith("hc_head_"):
            return f"mtp.{parts[1]}.hc_head.hc_{rest.removeprefix('hc_head_')}"
    return name


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {model_dir}: pass a Hugging Face checkpoint directory "
            "(create one with `rackserve model create --preset tiny --out DIR`)"
        )
    missing = [f for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shards listed in the index are missing: {missing}")
    return files


def open_shards(files: list[Path]) -> list[tuple[object, str]]:
    """(handle, tensor name) of every tensor across the shards; nothing is read yet."""
    names = []
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {f}: {e}") from None
        names.extend((handle, k) for k in handle.keys())  # noqa: SIM118 (not a dict)
    return names


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    kernels: str = "auto",
    expert_parallel: ExpertParallel | None = None,
    mtp_expert_parallel: ExpertParallel | None = None,
) -> DeepseekV4ForCausalLM:
    """Build the model from ``config.json`` and fill it from the safetensors files.
    ``kernels``: the op implementations (``rackserve.ops.KERNEL_CHOICES``);
    ``expert_parallel``: this rank's share of the routed experts (None: all of them);
    ``mtp_expert_parallel``: the MTP layers' share (their own EP model)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    files = checkpoint_files(model_dir)
    names = open_shards(files)
    with torch.device(device):
        with_mtp = any(k.startswith("mtp.") for _, k in names)
        model = DeepseekV4ForCausalLM(
            cfg,
            with_mtp=with_mtp,
            kernels=kernels,
            expert_parallel=expert_parallel,
            mtp_expert_parallel=mtp_expert_parallel,
        )
    model.cast(dtype)
    homes = expert_homes(model)
    names = [(h, k) for h, k in names if _held_here(k, homes, cfg.n_routed_experts)]
    if progress is None:
        progress = sum(f.stat().st_size for f in files) > 1 << 30
    bar = tqdm(names, desc="loading", unit="tensor", disable=not progress)
    load_weights(model, ((name, handle.get_tensor(name)) for handle, name in bar))
    return model.eval()


def check_checkpoint(model_dir: str | Path) -> None:
    """CheckpointError/ConfigError unless ``load_model`` would succeed on ``model_dir``
    (config, readable and complete shards, every tensor's name and shape). Reads only the
    safetensors headers and builds the model on the meta device, so it costs no weights'
    memory and lets ``serve`` fail in one line before any process starts."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    names = open_shards(checkpoint_files(model_dir))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=any(k.startswith("mtp.") for _, k in names))

    def shapes() -> Iterable[tuple[str, torch.Tensor]]:
        for handle, name in names:
            shape = handle.get_slice(name).get_shape()  # type: ignore[attr-defined]
            yield name, torch.empty(shape, device="meta")

    load_weights(model, shapes())


def expert_homes(model: DeepseekV4ForCausalLM) -> dict[str, dict[int, list[int]]]:
    """``"model.layers.3.ffn.experts"`` -> {logical expert: its local slots} of every
    ``Experts`` module (one rank: expert e in slot e)."""
    homes: dict[str, dict[int, list[int]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            slots: dict[int, list[int]] = {}
            for slot, expert in enumerate(module.slot_experts):
                slots.setdefault(expert, []).append(slot)
            homes[name] = slots
    return homes


def _held_here(raw_name: str, homes: dict[str, dict[int, list[int]]], num_experts: int) -> bool:
    """False for a routed expert's tensor that no local slot holds (skipped unread)."""
    m = _EXPERT.match(canonical_name(raw_name))
    if m is None or m.group(1) not in homes or int(m.group(2)) >= num_experts:
        return True  # not an expert of ours: load_weights judges it
    return int(m.group(2)) in homes[m.group(1)]


def load_weights(model: DeepseekV4ForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model; every parameter must be filled exactly once
    (every local expert slot, with expert parallelism)."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n.endswith("tid2eid"))
    expected = set(targets)
    homes = expert_homes(model)
    expert_slices: dict[str, set[int]] = {}
    unexpected, mismatched = [], []
    num_experts = model.cfg.n_routed_experts
    inter = model.cfg.moe_intermediate_size
    for raw_name, tensor in tensors:
        name = canonical_name(raw_name)
        m = _EXPERT.match(name)
        if m:
            prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
            target_name = f"{prefix}.{'w2' if which == 'w2' else 'w13'}"
            if target_name not in targets or expert >= num_experts:
                unexpected.append(raw_name)
                continue
            key = {"w1": 0, "w3": 1, "w2": 2}[which]
            for slot in homes[prefix].get(expert, []):
                dst = targets[target_name].data[slot]
                if which == "w1":
                    dst = dst[:inter]
                elif which == "w3":
                    dst = dst[inter:]
                if tuple(dst.shape) != tuple(tensor.shape):
                    mismatched.append(
                        f"{raw_name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}"
                    )
                    break
                dst.copy_(tensor.to(dst.dtype))
                expert_slices.setdefault(target_name, set()).add(slot * 3 + key)
            continue
        elif name in targets:
            dst = targets[name].data
            expected.discard(name)
        else:
            unexpected.append(raw_name)
            continue
        if tuple(dst.shape) != tuple(tensor.shape):
            mismatched.append(
                f"{raw_name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}"
            )
            continue
        dst.copy_(tensor.to(dst.dtype))
    for target_name, seen in expert_slices.items():
        per = 1 if target_name.endswith("w2") else 2
        if len(seen) == targets[target_name].shape[0] * per:
            expected.discard(target_name)
    problems = []
    if mismatched:
        problems.append(
            "shape mismatches (is config.json the one saved with these weights?): "
            + "; ".join(mismatched[:10])
        )
    if expected:
        problems.append(
            f"missing tensors: {sorted(expected)[:10]}"
            + (f" and {len(expected) - 10} more" if len(expected) > 10 else "")
        )
    if unexpected:
        problems.append(
            f"unexpected tensors: {sorted(unexpected)[:10]}"
            + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else "")
        )
    if problems:
        raise CheckpointError("checkpoint does not match config.json: " + " | ".join(problems))
