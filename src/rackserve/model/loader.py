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

Quantized checkpoints (``quantization_config``, ``model/quant.py``): a linear whose
checkpoint has a block scale (``weight_scale_inv``, DeepSeek: ``scale``) becomes an
``Fp8Linear`` holding the float8 weight and its fp32 scales; FP4 experts
(``expert_dtype: "fp4"``) stay packed, per expert (``experts.{e}.w1.weight`` + scale) or
fused as transformers holds them (``experts.gate_up_proj`` [E, 2I, D/2] +
``gate_up_proj_scale_inv``, ``experts.down_proj``); FP8 experts are dequantized once to the
model dtype. Scales may be float32 or ue8m0.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from rackserve.config import ModelConfig
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.layers import FP32_PARAM_SUFFIXES
from rackserve.model.moe import Experts
from rackserve.model.quant import quantize_linears_
from rackserve.moe.ep import ExpertParallel
from rackserve.ops.quant import FP8_BLOCK, FP8_DTYPE, dequantize_fp8, scale_to_float, stored_scale

Fetch = Callable[[str], "torch.Tensor | None"]


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names the fix."""


_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|weight_scale_inv)$")
# transformers' fused experts: every expert in one tensor
_FUSED = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")
_PACKED_DTYPES = (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
_ORIGINAL_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def canonical_name(name: str) -> str:
    """Map any accepted spelling to the ``save_pretrained`` one (block scales as
    ``weight_scale_inv``)."""
    if name.endswith(".scale"):  # DeepSeek's spelling of a weight's block scale
        name = name.removesuffix(".scale") + ".weight_scale_inv"
    name = name.replace(".mlp.experts.", ".ffn.experts.")
    return _canonical_module(name)


def _canonical_module(name: str) -> str:
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
    # Parameters made under inference mode (a caller's ``torch.inference_mode()``) are
    # inference tensors, and a Parameter keeps that (disabled) version counter even after
    # ``.data`` is replaced: then any view of it (``F.linear``'s transpose) fails with
    # "Inference tensors do not track version counter". Build and fill outside it.
    with torch.inference_mode(False), torch.no_grad():
        model_dir = Path(model_dir)
        cfg = ModelConfig.from_pretrained(model_dir)
        files = checkpoint_files(model_dir)
        names = open_shards(files)
        with torch.device(device), parameters_made_in(dtype):
            with_mtp = any(k.startswith("mtp.") for _, k in names)
            model = DeepseekV4ForCausalLM(
                cfg,
                with_mtp=with_mtp,
                kernels=kernels,
                expert_parallel=expert_parallel,
                mtp_expert_parallel=mtp_expert_parallel,
            )
        model.cast(dtype)
        quantize_linears_(model, fp8_linears(model, [k for _, k in names]), model.kernels)
        homes = expert_homes(model)
        names = [(h, k) for h, k in names if _held_here(k, homes, cfg.n_routed_experts)]
        if progress is None:
            progress = sum(f.stat().st_size for f in files) > 1 << 30
        bar = tqdm(names, desc="loading", unit="tensor", disable=not progress)
        handles = {k: h for h, k in names}
        load_weights(
            model,
            ((name, handle.get_tensor(name)) for handle, name in bar),
            lambda name: handles[name].get_tensor(name) if name in handles else None,
        )
    return model.eval()


@contextlib.contextmanager
def parameters_made_in(dtype: torch.dtype) -> Iterator[None]:
    """Floating-point parameters registered inside are stored in ``dtype`` as each module
    makes them: building the model in float32 and casting afterwards held the whole model
    in float32 at once, twice a bf16 checkpoint's bytes (a 30 GB one took 60 GiB of the GPU,
    counted against the KV budget). The float32 parameters of the reference
    (``FP32_PARAM_SUFFIXES``) go back to float32 in ``cast``; loading fills every value."""
    if dtype == torch.float32:
        yield
        return
    register = nn.Module.register_parameter

    def register_in_dtype(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.is_floating_point() and param.element_size() > 1:
            param = nn.Parameter(param.data.to(dtype), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_in_dtype  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


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
        quantize_linears_(model, fp8_linears(model, [k for _, k in names]), model.kernels)
    handles = {k: h for h, k in names}

    def meta(name: str) -> torch.Tensor | None:
        if name not in handles:
            return None
        shape, dtype = _header_tensor(handles[name], name)
        return torch.empty(shape, device="meta", dtype=dtype)

    load_weights(model, ((name, meta(name)) for _, name in names), meta)  # type: ignore[misc]


def _header_tensor(handle: object, name: str) -> tuple[list[int], torch.dtype]:
    """(shape, dtype) of tensor ``name`` as torch holds it, from its safetensors header."""
    info = handle.get_slice(name)  # type: ignore[attr-defined]
    shape, kind = list(info.get_shape()), info.get_dtype()
    if kind == "F4":  # the header counts e2m1 values; torch holds two per element
        shape[-1] //= 2
    return shape, _SAFETENSORS_DTYPES.get(kind, torch.float32)


def checkpoint_weight_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """About what ``load_model(model_dir, dtype)`` holds, from the safetensors headers alone:
    16- and 32-bit floats in ``dtype`` (as ``parameters_made_in`` stores them), the
    reference's float32 parameters (``FP32_PARAM_SUFFIXES``) in float32, 8-bit and packed
    4-bit tensors (fp8 weights, e8m0 scales) as stored."""
    total = 0
    for handle, name in open_shards(checkpoint_files(Path(model_dir))):
        shape, stored = _header_tensor(handle, name)
        if stored.is_floating_point and stored.itemsize > 1:
            fp32 = canonical_name(name).endswith(FP32_PARAM_SUFFIXES)
            stored = torch.float32 if fp32 else dtype
        total += math.prod(shape) * stored.itemsize
    return total


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


_SAFETENSORS_DTYPES = {
    "F8_E4M3": FP8_DTYPE,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
}


def fp8_linears(model: DeepseekV4ForCausalLM, names: list[str]) -> list[str]:
    """The model's linears that the checkpoint stores in FP8: those that have a block scale
    (expert scales aside). A scale for no linear of the model is a CheckpointError."""
    modules = dict(model.named_modules())
    out, strays = [], []
    for raw in names:
        name = canonical_name(raw)
        if not name.endswith(".weight_scale_inv") or _EXPERT.match(name) or _FUSED.match(name):
            continue
        module = name.removesuffix(".weight_scale_inv")
        if module in modules and hasattr(modules[module], "weight"):
            out.append(module)
        else:
            strays.append(raw)
    if strays:
        raise CheckpointError(f"block scales for no linear of the model: {sorted(strays)[:5]}")
    return out


def _convert(
    raw_name: str, tensor: torch.Tensor, dst: torch.Tensor, fetch: Fetch | None
) -> torch.Tensor:
    """The checkpoint tensor in the destination's storage (scales to fp32 or ue8m0 bytes,
    packed FP4 as uint8, FP8 experts dequantized); CheckpointError where it cannot be."""
    name = canonical_name(raw_name)
    if name.endswith("scale_inv"):
        if not tensor.is_floating_point() and tensor.dtype != torch.uint8:
            raise CheckpointError(f"{raw_name}: scales must be float or ue8m0, got {tensor.dtype}")
        if tensor.is_meta:
            return tensor.to(dst.dtype)
        try:
            return stored_scale(scale_to_float(tensor), dst.dtype)
        except ValueError as e:
            raise CheckpointError(f"{raw_name}: {e} (the config says scale_fmt ue8m0)") from None
    if dst.dtype == torch.uint8:  # packed FP4 experts
        if tensor.dtype not in _PACKED_DTYPES:
            raise CheckpointError(
                f"{raw_name}: FP4 experts (expert_dtype 'fp4') are packed int8, got {tensor.dtype}"
            )
        return tensor.view(torch.uint8) if not tensor.is_meta else tensor.to(torch.uint8)
    if tensor.dtype == FP8_DTYPE and dst.dtype != FP8_DTYPE:
        scale = None
        for candidate in (raw_name + "_scale_inv", raw_name.removesuffix("weight") + "scale"):
            scale = scale if scale is not None or fetch is None else fetch(candidate)
        if scale is None:
            raise CheckpointError(
                f"{raw_name} is float8 but the checkpoint has no scale for it "
                "(weight_scale_inv / scale): re-save it with its block scales"
            )
        if tensor.is_meta:
            return tensor.to(dst.dtype)
        return dequantize_fp8(tensor, scale, dst.dtype)
    if tensor.dtype in (torch.int8, torch.uint8) and dst.is_floating_point():
        raise CheckpointError(
            f"{raw_name} is packed {tensor.dtype}: FP4 experts need "
            "quantization_config.expert_dtype = 'fp4' in config.json"
        )
    return tensor.to(dst.dtype)


def _scale_shape_error(raw_name: str, tensor: torch.Tensor, dst: torch.Tensor) -> str:
    if canonical_name(raw_name).endswith("scale_inv"):
        bn, bk = FP8_BLOCK
        return (
            f"{raw_name}: scale grid {tuple(tensor.shape)}, expected {tuple(dst.shape)} "
            f"(one scale per {bn}x{bk} block, or per 32 inputs for FP4 experts): "
            "is weight_block_size right?"
        )
    return f"{raw_name}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}"


def _expert_target(name: str, which: str, scale: bool) -> str:
    base = "w2" if which in ("w2", "down_proj") else "w13"
    return f"{name}.{base}_scale" if scale else f"{name}.{base}"


def load_weights(
    model: DeepseekV4ForCausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    fetch: Fetch | None = None,
) -> None:
    """Copy checkpoint tensors into the model; every parameter must be filled exactly once
    (every local expert slot, with expert parallelism). ``fetch(name)``: another tensor of
    the checkpoint (a weight's scale) or None."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n.endswith("tid2eid"))
    expected = set(targets)
    homes = expert_homes(model)
    filled: dict[str, set[tuple[int, int]]] = {}  # expert target -> (slot, row half)
    unexpected, mismatched = [], []
    num_experts = model.cfg.n_routed_experts
    for raw_name, tensor in tensors:
        name = canonical_name(raw_name)
        m, fused = _EXPERT.match(name), _FUSED.match(name)
        if m or fused:
            prefix = (m or fused).group(1)  # type: ignore[union-attr]
            which = m.group(3) if m else fused.group(2)  # type: ignore[union-attr]
            is_scale = (m.group(4) if m else fused.group(3) or "").endswith("scale_inv")  # type: ignore[union-attr]
            target_name = _expert_target(prefix, which, is_scale)
            if target_name not in targets:
                if is_scale and f"{prefix}.w13" in targets:
                    continue  # FP8 experts: the scale was read with its weight
                unexpected.append(raw_name)
                continue
            param = targets[target_name].data
            if m:
                expert = int(m.group(2))
                if expert >= num_experts:
                    unexpected.append(raw_name)
                    continue
                pairs = [(expert, slot) for slot in homes[prefix].get(expert, [])]
                source = [tensor] * len(pairs)
            else:
                local = homes[prefix]
                pairs = [(e, slot) for e, slots in local.items() for slot in slots]
                if tensor.shape[0] != num_experts:
                    mismatched.append(
                        f"{raw_name}: {tensor.shape[0]} experts, {num_experts} in config"
                    )
                    continue
                if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
                    tensor = _convert(raw_name, tensor, param, fetch)  # dequantize all at once
                source = [tensor[e] for e, _ in pairs]
            half = param.shape[1] // 2
            rows = {"w1": slice(0, half), "w3": slice(half, None)}.get(which, slice(None))
            for (_, slot), src in zip(pairs, source, strict=True):
                dst = param[slot][rows]
                src = _convert(raw_name, src, dst, fetch)
                if tuple(dst.shape) != tuple(src.shape):
                    mismatched.append(_scale_shape_error(raw_name, src, dst))
                    break
                dst.copy_(src)
                parts = (0, 1) if rows == slice(None) else (0 if which == "w1" else 1,)
                filled.setdefault(target_name, set()).update((slot, p) for p in parts)
            continue
        if name not in targets:
            unexpected.append(raw_name)
            continue
        dst = targets[name].data
        expected.discard(name)
        src = _convert(raw_name, tensor, dst, fetch)
        if tuple(dst.shape) != tuple(src.shape):
            mismatched.append(_scale_shape_error(raw_name, src, dst))
            continue
        dst.copy_(src)
    for target_name, seen in filled.items():
        if len(seen) == targets[target_name].shape[0] * 2:
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
