"""``rackserve bench balance``: expert-parallel balancedness of a routing trace.

Shape legend: L MoE layers, T tokens, k experts per token, E logical experts, N EP ranks.

From a routing trace (recorded, or synthetic with Zipf-like expert popularity) it reports
per layer and EP size: balancedness (mean rank load / max rank load, per step, averaged)
for the real routing on the default placement (experts split contiguously over the
ranks), for uniform random top-k routing of the same steps (the ceiling), and for the real
routing after EPLB. EPLB is fitted on the first half of the trace and scored on the
second (out of sample), and larger EP sizes are simulated by drawing bigger steps from the
same trace. "Gap recovered" = (eplb - real) / (uniform - real).
"""

from __future__ import annotations

import argparse
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rackserve.moe.eplb import rebalance_experts
from rackserve.moe.placement import choose_replicas
from rackserve.moe.skew import sample_topk, synthetic_trace
from rackserve.moe.stats import balancedness


@dataclass(frozen=True)
class BalanceConfig:
    ep_sizes: tuple[int, ...] = (8, 16, 32, 72)
    tokens_per_rank: int = 64  # decode batch per rank per step
    num_steps: int = 20
    redundant_experts: int | None = None  # None: enough for one more slot per rank
    num_groups: int = 1
    num_nodes: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.ep_sizes or min(self.ep_sizes) < 1:
            raise ValueError("--ep-size and --simulate-ep must be positive integers")
        if self.tokens_per_rank < 1 or self.num_steps < 1:
            raise ValueError("--tokens-per-rank and --steps must be >= 1")


@dataclass(frozen=True)
class SyntheticTrace:
    num_layers: int = 8
    num_experts: int = 256
    top_k: int = 6
    num_tokens: int = 8192
    zipf_exponent: float = 1.2
    seed: int = 0

    def build(self) -> torch.Tensor:
        return synthetic_trace(
            self.num_layers,
            self.num_experts,
            self.top_k,
            self.num_tokens,
            self.zipf_exponent,
            self.seed,
        )


def load_trace(path: str | Path) -> tuple[torch.Tensor, int]:
    """A saved trace: ``torch.save({"topk_ids": [L, T, k] int, "num_experts": E}, path)``."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as error:
        raise ValueError(f"{path}: not a torch.save'd trace ({error})") from None
    if not isinstance(data, dict) or "topk_ids" not in data or "num_experts" not in data:
        raise ValueError(f"{path}: expected a dict with 'topk_ids' [L, T, k] and 'num_experts'")
    ids, num_experts = data["topk_ids"].long(), int(data["num_experts"])
    if ids.dim() != 3 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= num_experts:
        raise ValueError(f"{path}: topk_ids must be [L, T, k] ids in [0, {num_experts})")
    return ids, num_experts


def default_num_slots(num_experts: int, ep_size: int, redundant: int | None) -> int:
    """Slots for EPLB at one EP size: E + redundant, a multiple of the EP size."""
    if redundant is None:
        return ep_size * -(-(num_experts + 1) // ep_size)
    if (num_experts + redundant) % ep_size:
        raise ValueError(
            f"{num_experts} experts + {redundant} redundant do not split over EP{ep_size}"
        )
    return num_experts + redundant


def _contiguous_rank(num_experts: int, ep_size: int) -> torch.Tensor:
    """Default placement without EPLB: expert e on rank floor(e * N / E) (any E, N)."""
    return torch.arange(num_experts) * ep_size // num_experts


def _step_balancedness(rank_of_choice: torch.Tensor, ep_size: int) -> float:
    """rank_of_choice: [steps, tokens * k] -> mean over steps of per-step balancedness."""
    loads = torch.zeros(rank_of_choice.shape[0], ep_size, dtype=torch.float64)
    loads.scatter_add_(1, rank_of_choice, torch.ones_like(rank_of_choice, dtype=torch.float64))
    return float(balancedness(loads).mean())


def evaluate(trace: torch.Tensor, num_experts: int, config: BalanceConfig) -> dict[str, Any]:
    """trace: [L, T, k] logical ids. Returns per EP size the per-layer balancedness of real,
    uniform and EPLB routing, and summaries."""
    num_layers, num_tokens, top_k = trace.shape
    if num_tokens < 2:
        raise ValueError("the trace needs at least 2 tokens per layer (fit half, score half)")
    fit, score = trace[:, : num_tokens // 2], trace[:, num_tokens // 2 :]
    fit_load = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    fit_load.scatter_add_(1, fit.flatten(1), torch.ones(fit.flatten(1).shape, dtype=torch.float64))
    gen = torch.Generator().manual_seed(config.seed)
    uniform = torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64)
    results = []
    for ep_size in config.ep_sizes:
        num_slots = default_num_slots(num_experts, ep_size, config.redundant_experts)
        placement = rebalance_experts(
            fit_load, num_slots, config.num_groups, config.num_nodes, ep_size
        )
        home = _contiguous_rank(num_experts, ep_size)
        step_tokens = config.tokens_per_rank * ep_size
        layers = []
        for layer in range(num_layers):
            # Steps are drawn from the scored half (with replacement: simulated EP sizes
            # need more tokens per step than a small-rank trace has).
            pick = torch.randint(0, score.shape[1], (config.num_steps, step_tokens), generator=gen)
            ids = score[layer][pick]  # [steps, tokens, k]
            random_ids = sample_topk(uniform, config.num_steps * step_tokens, top_k, gen)
            slots = choose_replicas(
                ids.flatten(0, 1),
                placement.logical_to_physical[layer],
                placement.replica_count[layer],
            ).view(config.num_steps, -1)
            real = _step_balancedness(home[ids].flatten(1), ep_size)
            ceiling = _step_balancedness(home[random_ids].view(config.num_steps, -1), ep_size)
            eplb = _step_balancedness(slots // placement.slots_per_rank, ep_size)
            gap = (eplb - real) / (ceiling - real) if ceiling > real else None
            layers.append(
                {
                    "layer": layer,
                    "real": real,
                    "uniform": ceiling,
                    "eplb": eplb,
                    "gap_recovered": gap,
                }
            )
        results.append(_summary(ep_size, num_slots, layers))
    return {
        "num_layers": num_layers,
        "num_experts": num_experts,
        "top_k": top_k,
        "trace_tokens": num_tokens,
        "config": _config_dict(config),
        "ep": results,
    }


def _summary(ep_size: int, num_slots: int, layers: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str) -> float:
        return sum(row[key] for row in layers) / len(layers)

    real, ceiling, eplb = mean("real"), mean("uniform"), mean("eplb")
    return {
        "ep_size": ep_size,
        "num_slots": num_slots,
        "real": real,
        "uniform": ceiling,
        "eplb": eplb,
        "min_real": min(r["real"] for r in layers),
        "min_eplb": min(r["eplb"] for r in layers),
        "gap_recovered": (eplb - real) / (ceiling - real) if ceiling > real else None,
        "layers": layers,
    }


def _config_dict(config: BalanceConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(config).items()}


BALANCE_COLUMNS = (
    ("ep_size", "EP", 0),
    ("num_slots", "slots", 0),
    ("real", "real", 3),
    ("uniform", "uniform", 3),
    ("eplb", "EPLB", 3),
    ("min_real", "min real", 3),
    ("min_eplb", "min EPLB", 3),
    ("gap_recovered", "gap recovered", 3),
)
LAYER_COLUMNS = (
    ("layer", "layer", 0),
    ("real", "real", 3),
    ("uniform", "uniform", 3),
    ("eplb", "EPLB", 3),
    ("gap_recovered", "gap recovered", 3),
)


def format_balance_report(result: dict[str, Any]) -> str:
    from rackserve.bench.report import format_table

    first = result["ep"][0]
    return "\n".join(
        [
            f"balancedness (mean/max rank load per step), {result['num_layers']} layers, "
            f"E={result['num_experts']}, top-{result['top_k']}",
            format_table(result["ep"], BALANCE_COLUMNS),
            "",
            f"per layer at EP{first['ep_size']}:",
            format_table(first["layers"], LAYER_COLUMNS),
        ]
    )


def plot_balance(result: dict[str, Any], path: str | Path) -> Path:
    """Per-layer real / uniform / EPLB balancedness, one panel per EP size."""
    from matplotlib.figure import Figure

    from rackserve.bench.report import _save

    panels = result["ep"]
    figure = Figure(figsize=(4 * len(panels), 3.2), layout="constrained")
    for axes, ep in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        x = [row["layer"] for row in ep["layers"]]
        for key, style in (("uniform", "k--"), ("eplb", "g-o"), ("real", "r-o")):
            axes.plot(x, [row[key] for row in ep["layers"]], style, label=key, markersize=3)
        axes.set_title(f"EP{ep['ep_size']} ({ep['num_slots']} slots)")
        axes.set_xlabel("MoE layer")
        axes.set_ylim(0, 1.05)
    figure.axes[0].set_ylabel("balancedness")
    figure.axes[0].legend(fontsize="small")
    return _save(figure, path)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 16,32,72 (got {text!r})"
        ) from None


def register_balance(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "balance",
        help="EP balancedness of a routing trace: real vs uniform vs after EPLB",
        description=__doc__.split("\n\n")[1],
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", choices=("zipf",), help="a synthetic Zipf trace")
    source.add_argument("--trace", metavar="FILE", help="torch.save'd {topk_ids, num_experts}")
    parser.add_argument("--ep-size", type=int, default=8, help="the EP size (default 8)")
    parser.add_argument(
        "--simulate-ep",
        type=_int_list,
        default=(16, 32, 72),
        metavar="N,N",
        help="larger EP sizes to simulate (default 16,32,72)",
    )
    parser.add_argument(
        "--redundant-experts",
        type=int,
        default=None,
        help="default: enough for one extra slot per rank",
    )
    parser.add_argument("--num-groups", type=int, default=1, help="expert groups (hierarchical)")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (hierarchical)")
    parser.add_argument("--tokens-per-rank", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    synthetic = parser.add_argument_group("synthetic trace")
    synthetic.add_argument("--num-layers", type=int, default=8)
    synthetic.add_argument("--num-experts", type=int, default=256)
    synthetic.add_argument("--top-k", type=int, default=6)
    synthetic.add_argument("--num-tokens", type=int, default=8192)
    synthetic.add_argument("--zipf-exponent", type=float, default=1.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", metavar="FILE", help="write JSON here (and a PNG beside it)")
    parser.set_defaults(func=_balance_main)


def _balance_main(args: argparse.Namespace) -> int:
    from rackserve.bench.report import write_json

    if args.trace:
        trace, num_experts = load_trace(args.trace)
    else:
        trace = SyntheticTrace(
            args.num_layers,
            args.num_experts,
            args.top_k,
            args.num_tokens,
            args.zipf_exponent,
            args.seed,
        ).build()
        num_experts = args.num_experts
    sizes = (args.ep_size, *(n for n in args.simulate_ep if n != args.ep_size))
    config = BalanceConfig(
        sizes,
        args.tokens_per_rank,
        args.steps,
        args.redundant_experts,
        args.num_groups,
        args.num_nodes,
        args.seed,
    )
    result = evaluate(trace, num_experts, config)
    result["source"] = args.trace or f"synthetic zipf {args.zipf_exponent}"
    print(format_balance_report(result))
    if args.output:
        print(f"wrote {write_json(result, args.output)}")
        print(f"wrote {plot_balance(result, Path(args.output).with_suffix('.png'))}")
    return 0


__all__ = ["BalanceConfig", "evaluate", "load_trace", "register_balance"]
