"""`rackserve model create` and `rackserve generate`."""

from __future__ import annotations

import argparse
from pathlib import Path

from rackserve.config import EXPERT_DTYPES, SCALE_FORMATS, ConfigError, QuantConfig
from rackserve.model.presets import PRESETS, preset_config

QUANTIZATION_CHOICES = ("none", "fp8")


def quant_config(
    quantization: str | None, expert_dtype: str | None = None, scale_fmt: str | None = None
) -> QuantConfig | None:
    """The ``--quantization / --expert-dtype / --scale-fmt`` flags as a QuantConfig (None:
    full precision). fp8 defaults to DeepSeek-V4-Flash's own format: FP4 experts, ue8m0."""
    if quantization in (None, "none"):
        if expert_dtype or scale_fmt:
            raise ConfigError("--expert-dtype / --scale-fmt need --quantization fp8")
        return None
    if quantization != "fp8":
        raise ConfigError(f"--quantization must be one of {QUANTIZATION_CHOICES}")
    return QuantConfig(expert_dtype=expert_dtype or "fp4", scale_fmt=scale_fmt or "ue8m0")


def add_quantization_args(parser) -> None:
    """The flags of ``quant_config`` (``model create``, ``bench forward``)."""
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="fp8: linears in FP8 with 128x128 block scales (DeepSeek-V4's format)",
    )
    parser.add_argument(
        "--expert-dtype",
        choices=EXPERT_DTYPES,
        default=None,
        help="routed experts with --quantization fp8 (default fp4: e2m1, a scale per 32)",
    )
    parser.add_argument(
        "--scale-fmt", choices=SCALE_FORMATS, default=None, help="block scales (default ue8m0)"
    )


def _create(args: argparse.Namespace) -> int:
    import dataclasses

    from rackserve.device import parse_dtype
    from rackserve.model.create import create_checkpoint

    cfg = preset_config(args.preset, args.layers, args.experts)
    quantization = quant_config(args.quantization, args.expert_dtype, args.scale_fmt)
    cfg = dataclasses.replace(cfg, quantization=quantization)
    dtype = parse_dtype(args.dtype or ("float32" if args.preset == "tiny" else "bfloat16"), "cpu")
    out = create_checkpoint(
        cfg, args.out, seed=args.seed, dtype=dtype, with_mtp=not args.no_mtp, device=args.device
    )
    stored = str(dtype).removeprefix("torch.")
    if quantization is not None:
        stored = (
            f"fp8 linears, {quantization.expert_dtype} experts, {quantization.scale_fmt} scales"
        )
    print(
        f"wrote {args.preset} checkpoint ({cfg.num_hidden_layers} layers, "
        f"{cfg.n_routed_experts} experts, {stored}) to {out}"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from rackserve.llm import LLM
    from rackserve.request import SamplingParams

    if not args.prompt:
        raise ValueError("--prompt is empty")
    llm = LLM(
        str(args.model),
        dtype=args.dtype or "auto",
        device=args.device or "auto",
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
    )
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    print(llm.generate(args.prompt, params)[0].outputs[0].text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="create checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    create = model_sub.add_parser("create", help="write a random-weight checkpoint + tokenizer")
    create.add_argument("--preset", choices=PRESETS, default="tiny")
    create.add_argument("--layers", type=int, default=None, help="number of layers")
    create.add_argument("--experts", type=int, default=None, help="number of routed experts")
    create.add_argument("--seed", type=int, default=0)
    create.add_argument("--dtype", default=None, help="float32 (tiny default) or bfloat16")
    create.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer(s)")
    create.add_argument(
        "--device",
        default="cpu",
        help="where the weights are drawn: cpu (default; the same checkpoint on every "
        "machine) or cuda (for large presets, whose CPU draw takes over a minute; other "
        "values, as reproducible)",
    )
    add_quantization_args(create)
    create.add_argument("--out", type=Path, required=True)
    create.set_defaults(func=_create)

    gen = subparsers.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    gen.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    gen.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\' (as serve)',
    )
    gen.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while N runs (as serve; default: on a GPU where supported)",
    )
    gen.set_defaults(func=_generate)
