"""DEP on two GPUs over NCCL (issue 16's GPU section), the driver of benchmarks/gpu_dep.sh.

Parts, each one JSON section of ``OUT/dep.json`` (a failing part records its error, the
others still run):

1. ``equality``: greedy tokens of DEP2 engine ranks (EngineCore, expert parallel over the
   EP group) against one device's engine on the same checkpoint; bf16 tolerance: a token
   may differ only where the one-device logprobs of its top two are within ``--tie-tol``.
2. ``dispatch``: all-to-all dispatch and combine latency and bandwidth against tokens per
   rank, with V4-Flash's hidden size, top-k and expert count, uniform routing.
3. ``decode``: the v4-flash preset (``--layers`` layers, weights initialised on the device)
   decoding ``--requests`` requests per GPU at ``--context``: DEP1 (one GPU, every expert)
   against DEP2 (two GPUs, half the experts each), per-GPU tokens/s and the step split
   into routed experts (MoE), dispatch/combine and the rest (CUDA events around each).
4. ``eplb``: the same model with Zipf-skewed routing: balancedness before and after a
   rebalance (and the uniform-routing reference), and the slowest step while the weights
   move (one layer per step) against the median step.
5. ``memory`` (issue 20): the whole V4-Flash (43 layers + MTP, 256 experts) in its own
   format (FP8 block-scaled linears, FP4 experts) built on each GPU with expert parallelism
   over the two: the bytes each GPU holds (``torch.cuda.memory_allocated``) against the
   weight bytes counted from its parameters, and the full model's count on one device.

``--smoke``: the same code on the CPU, gloo, tiny sizes (seconds): what CI-less machines
and reviewers run before a device call.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.config import (
    CacheConfig,
    EngineConfig,
    EPLBConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.dp import run_until_idle
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint, init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config, tiny_config
from rackserve.moe.dispatch import AllToAllDispatcher
from rackserve.moe.ep import ExpertParallel
from rackserve.moe.placement import ExpertPlacement
from rackserve.moe.skew import apply_skewed_routing
from rackserve.parallel.groups import ParallelGroups
from rackserve.parallel.launch import run_ranks
from rackserve.request import SamplingParams
from rackserve.runner.step_buffers import StepBuffers


@dataclass(frozen=True)
class Sizes:
    device: str
    backend: str
    preset: str  # the decode / EPLB model
    layers: int
    experts: int
    requests: int  # decode requests per GPU
    context: int
    dispatch_tokens: tuple[int, ...]
    hidden: int  # dispatch rows' width
    top_k: int
    iters: int
    warmup: int
    equality_requests: int
    equality_tokens: int
    eplb_window: int
    skew: float
    kv_bytes: int


GPU = Sizes(
    "cuda", "nccl", "v4-flash", 4, 256, 64, 4096,
    (128, 256, 512, 1024, 2048, 4096, 8192), 4096, 6, 20, 5, 16, 32, 8, 1.2, 2 << 30,
)  # fmt: skip
SMOKE = Sizes(
    "cpu", "gloo", "tiny", 2, 8, 4, 64, (8, 32), 64, 2, 3, 1, 4, 4, 3, 1.2, 24 << 20
)  # fmt: skip


# ---- timing -----------------------------------------------------------------------------
class Spans:
    """Named time spans inside a step: CUDA events on a GPU (read after the step's sync),
    wall time on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.open: dict[str, list[Any]] = {}

    @contextmanager
    def span(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.open.setdefault(name, []).append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.open.setdefault(name, []).append(time.perf_counter() - t0)

    def collect(self) -> dict[str, float]:
        """Seconds per name since the last collect (call after synchronising)."""
        out = {}
        for name, spans in self.open.items():
            if self.cuda:
                out[name] = sum(s.elapsed_time(e) for s, e in spans) / 1e3
            else:
                out[name] = sum(spans)
        self.open = {}
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_device(groups: ParallelGroups, sizes: Sizes) -> torch.device:
    if sizes.device == "cuda":
        torch.cuda.set_device(groups.rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- 1. equality ------------------------------------------------------------------------
def _engine_config(model_dir: Path, sizes: Sizes, parallel: ParallelConfig) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=sizes.kv_bytes),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512),
        device=sizes.device,
        parallel=parallel,
    )


def _prompts(sizes: Sizes) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"r{i}": torch.randint(2, 4000, (8 + 11 * i,), generator=gen).tolist()
        for i in range(sizes.equality_requests)
    }


def _generate(core: EngineCore, requests: dict[str, list[int]], sizes: Sizes, run) -> dict:
    params = SamplingParams(
        temperature=0.0, max_tokens=sizes.equality_tokens, ignore_eos=True, logprobs=2
    )
    for req_id, ids in requests.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    top: dict[str, list[list[float]]] = {r: [] for r in requests}
    for step in run():
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
            # per step: the distinct top tokens' logprobs, best first (the sampled token
            # repeats the top one under greedy)
            top[out.request_id] += [
                sorted(dict(zip(lp.token_ids, lp.logprobs, strict=True)).values(), reverse=True)
                for lp in out.new_logprobs or []
            ]
    return {"tokens": tokens, "top_logprobs": top}


def equality_worker(groups: ParallelGroups, model_dir: str, sizes: Sizes) -> dict:
    _set_device(groups, sizes)
    parallel = ParallelConfig(data_parallel_size=groups.world_size, enable_expert_parallel=True)
    core = EngineCore(
        _engine_config(Path(model_dir), sizes, parallel), log_stats=False, groups=groups
    )
    names = list(_prompts(sizes))
    mine = {n: _prompts(sizes)[n] for n in names[groups.rank :: groups.world_size]}
    return _generate(core, mine, sizes, lambda: run_until_idle(core, groups))


def _single_device(model_dir: Path, sizes: Sizes) -> dict:
    """The one-device reference (this process, device 0); its engine is freed on return."""
    core = EngineCore(_engine_config(model_dir, sizes, ParallelConfig()), log_stats=False)

    def steps():
        while core.has_unfinished_requests():
            yield core.step()

    return _generate(core, _prompts(sizes), sizes, steps)


def equality(sizes: Sizes, work: Path, tie_tol: float) -> dict:
    cfg = tiny_config(num_layers=4, num_experts=16, vocab_size=4096)
    model_dir = create_checkpoint(cfg, work / "equality", seed=1, with_mtp=False)
    reference = _single_device(model_dir, sizes)
    _free_device_memory(sizes)
    results = run_ranks(equality_worker, 2, str(model_dir), sizes, backend=sizes.backend)
    per_request = {}
    for result in results:
        for req_id, got in result["tokens"].items():
            want = reference["tokens"][req_id]
            diverge = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
            )
            prefix = len(want) if diverge is None else diverge
            diffs = [
                abs(g[0] - w[0])
                for g, w in zip(
                    result["top_logprobs"][req_id][:prefix],
                    reference["top_logprobs"][req_id][:prefix],
                    strict=False,
                )
            ]
            gap = None
            if diverge is not None:
                top = reference["top_logprobs"][req_id][diverge]
                gap = top[0] - top[1] if len(top) > 1 else None
            per_request[req_id] = {
                "equal": diverge is None,
                "first_divergence": diverge,
                "reference_top2_gap_there": gap,
                "max_abs_logprob_diff_before": max(diffs, default=0.0),
            }
    within = all(
        r["equal"]
        or (r["reference_top2_gap_there"] is not None and r["reference_top2_gap_there"] <= tie_tol)
        for r in per_request.values()
    )
    return {
        "model": "tiny (4 layers, 16 experts)",
        "requests": len(per_request),
        "tokens_per_request": sizes.equality_tokens,
        "all_equal": all(r["equal"] for r in per_request.values()),
        "within_bf16_tolerance": within,
        "tie_tol": tie_tol,
        "per_request": per_request,
    }  # fmt: skip


# ---- 2. dispatch / combine --------------------------------------------------------------
def dispatch_worker(groups: ParallelGroups, sizes: Sizes) -> list[dict]:
    device = _set_device(groups, sizes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    placement = ExpertPlacement.default(1, sizes.experts, groups.ep_size).to(device)
    dispatcher = AllToAllDispatcher(placement, groups.ep_group)
    gen = torch.Generator(device=device).manual_seed(groups.rank)
    spans = Spans(device.type == "cuda")
    rows = []
    for num_tokens in sizes.dispatch_tokens:
        x = torch.randn(num_tokens, sizes.hidden, device=device, dtype=dtype, generator=gen)
        noise = torch.rand(num_tokens, sizes.experts, device=device, generator=gen)
        ids = noise.topk(sizes.top_k, dim=1).indices
        weights = torch.rand(num_tokens, sizes.top_k, device=device, generator=gen).to(dtype)
        per_rank = sizes.experts // groups.ep_size
        remote = int((ids // per_rank != groups.ep_rank).sum())  # rows leaving this rank
        times: dict[str, list[float]] = {"dispatch": [], "combine": []}
        for i in range(sizes.warmup + sizes.iters):
            _sync(device)
            with spans.span("dispatch"):
                routed = dispatcher.dispatch(0, x, ids, weights)
            with spans.span("combine"):
                dispatcher.combine(routed.hidden, routed)  # identity experts: the exchange alone
            _sync(device)
            got = spans.collect()
            if i >= sizes.warmup:
                for k in times:
                    times[k].append(got[k])
        bytes_out = remote * sizes.hidden * x.element_size()
        row = {"tokens_per_rank": num_tokens, "rows_sent_remote": remote, "bytes_sent": bytes_out}
        for k, values in times.items():
            median = statistics.median(values)
            row[f"{k}_us"] = median * 1e6
            row[f"{k}_gb_per_s"] = bytes_out / median / 1e9
        rows.append(row)
    return rows


# ---- 3. decode, 4. EPLB -----------------------------------------------------------------
def _model(sizes: Sizes, groups: ParallelGroups, device: torch.device, eplb: EPLBConfig | None):
    cfg = (
        preset_config(sizes.preset, sizes.layers, sizes.experts)
        if sizes.preset != "tiny"
        else tiny_config(num_layers=sizes.layers, num_experts=sizes.experts, vocab_size=512)
    )
    ep = ExpertParallel(
        cfg.num_hidden_layers, cfg.n_routed_experts, cfg.n_routed_experts, groups, device,
        eplb=eplb, window_size=eplb.window_size if eplb else 8,
    )  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False, expert_parallel=ep)
    init_model_(model.cast(dtype), seed=0)
    return model.eval(), ep


class _Instrumented:
    """One eager decode step of a synthetic batch with the MoE pieces timed."""

    def __init__(self, model: DeepseekV4ForCausalLM, ep: ExpertParallel, sizes: Sizes) -> None:
        import rackserve.model.moe as moe_module

        self.model, self.ep = model, ep
        self.device = next(model.parameters()).device
        self.spans = spans = Spans(self.device.type == "cuda")
        synthetic = synthetic_step(model, BatchSpec("decode", sizes.requests, 1, sizes.context))
        buffers = StepBuffers(synthetic.groups, synthetic.input_batch.block_tables, self.device)
        inputs, writes = synthetic.step.inputs, synthetic.step.table_writes
        self.input_ids, self.meta, self.logits_indices = buffers.eager_step(inputs, writes)
        self.caches = synthetic.caches
        dispatcher = ep.dispatcher
        dispatch, combine = dispatcher.dispatch, dispatcher.combine

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                with spans.span(name):
                    return fn(*args, **kwargs)

            return wrapper

        dispatcher.dispatch = timed("dispatch_combine", dispatch)
        dispatcher.combine = timed("dispatch_combine", combine)
        moe_module.run_local_experts = timed("moe", moe_module.run_local_experts)

    @torch.inference_mode()
    def step(self, end_step: bool = False) -> dict[str, float]:
        _sync(self.device)
        t0 = time.perf_counter()
        hidden, _ = self.model(self.input_ids, self.meta, self.caches)
        self.model.compute_logits(hidden[self.logits_indices])
        if end_step:
            self.ep.end_step()  # statistics; lands one rearranged layer while moving
        _sync(self.device)
        total = time.perf_counter() - t0
        split = self.spans.collect()
        moe, comm = split.get("moe", 0.0), split.get("dispatch_combine", 0.0)
        return {
            "total_s": total,
            "moe_s": moe,
            "dispatch_combine_s": comm,
            "rest_s": total - moe - comm,
        }


def _decode_run(groups: ParallelGroups, sizes: Sizes) -> dict:
    device = _set_device(groups, sizes)
    model, ep = _model(sizes, groups, device, None)
    step = _Instrumented(model, ep, sizes)
    runs = [step.step() for _ in range(sizes.warmup + sizes.iters)][sizes.warmup :]
    median = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]  # its split adds up
    return {
        "dep": groups.ep_size,
        "requests_per_gpu": sizes.requests,
        "step_ms": {k.removesuffix("_s"): v * 1e3 for k, v in median.items()},
        "tok_s_per_gpu": sizes.requests / median["total_s"],
        "local_experts": model.model.layers[0].ffn.experts.w13.shape[0],
    }


def decode_worker(groups: ParallelGroups, sizes: Sizes) -> dict:
    return _decode_run(groups, sizes)


def eplb_worker(groups: ParallelGroups, sizes: Sizes) -> dict:
    device = _set_device(groups, sizes)
    window = sizes.eplb_window
    model, ep = _model(sizes, groups, device, EPLBConfig(window_size=window, step_interval=1 << 30))
    apply_skewed_routing(model, sizes.skew, seed=0)
    step = _Instrumented(model, ep, sizes)
    for _ in range(sizes.warmup):
        step.step(end_step=True)
    steady = [step.step(end_step=True)["total_s"] for _ in range(window)]
    before, uniform = ep.balancedness()
    ep.rebalance()
    moving = []
    while ep.rearranging:
        moving.append(step.step(end_step=True)["total_s"])
    after_steps = [step.step(end_step=True)["total_s"] for _ in range(window)]
    after, uniform_after = ep.balancedness()
    median = statistics.median(steady + after_steps)
    return {
        "skew": sizes.skew,
        "balancedness_before": before,
        "balancedness_after": after,
        "balancedness_uniform": uniform,
        "balancedness_uniform_after": uniform_after,
        "median_step_ms": median * 1e3,
        "median_step_ms_before": statistics.median(steady) * 1e3,
        "median_step_ms_after": statistics.median(after_steps) * 1e3,
        "rearranging_steps": len(moving),
        "slowest_rearranging_step_ms": max(moving, default=0.0) * 1e3,
        "slowest_over_median": max(moving, default=0.0) / median,
    }


# ---- 5. memory ---------------------------------------------------------------------------
def _format_config(sizes: Sizes):
    """V4-Flash whole (the tiny model with --smoke) in its own format: FP8 linears, FP4
    experts."""
    from rackserve.config import QuantConfig

    cfg = preset_config("v4-flash") if sizes.device == "cuda" else tiny_config(num_experts=8)
    return replace(cfg, quantization=QuantConfig())


def _quantized(cfg, device: torch.device, groups: ParallelGroups | None = None):
    """The model on ``device`` (experts split over ``groups`` when given, the MTP layers'
    too): FP4 experts are built packed, the dense linears in bf16 then quantized to FP8.
    The values stay uninitialised: only the bytes are measured."""
    from rackserve.model.quant import fp8_linear_names, quantize_linears_

    ep = mtp = None
    if groups is not None:
        e, layers = cfg.n_routed_experts, cfg.num_hidden_layers
        ep = ExpertParallel(layers, e, e, groups, device)
        mtp = ExpertParallel(cfg.num_nextn_predict_layers, e, e, groups, device,
                             first_layer=layers, name="mtp")  # fmt: skip
    with torch.device(device):
        model = DeepseekV4ForCausalLM(
            cfg, with_mtp=True, expert_parallel=ep, mtp_expert_parallel=mtp
        )
        model.cast(torch.bfloat16)
        quantize_linears_(model, fp8_linear_names(model), model.kernels)
    return model


def memory_worker(groups: ParallelGroups, sizes: Sizes) -> dict:
    from rackserve.model.quant import weight_memory

    device = _set_device(groups, sizes)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    model = _quantized(_format_config(sizes), device, groups)
    record = {"rank": groups.rank, "counted": weight_memory(model), "allocated": None}
    if cuda:
        torch.cuda.synchronize(device)
        record |= {
            "allocated": torch.cuda.memory_allocated(device) - before,
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "gpu_total": torch.cuda.get_device_properties(device).total_memory,
        }
    return record


# ---- driver -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for dep.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes")
    parser.add_argument("--parts", default="equality,dispatch,decode,eplb,memory")
    parser.add_argument("--layers", type=int, help="decode/EPLB model layers (default 4)")
    parser.add_argument("--tie-tol", type=float, default=0.05, help="bf16 top-2 logprob gap")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else GPU
    if args.layers:
        sizes = Sizes(**{**asdict(sizes), "layers": args.layers})
    if sizes.device == "cuda" and torch.cuda.device_count() < 2:
        print("gpu_dep: needs 2 GPUs (or --smoke)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"sizes": asdict(sizes), "device": _device_name(sizes)}
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            t0 = time.perf_counter()
            try:
                result[part] = _run_part(part, sizes, Path(tmp), args.tie_tol)
            except Exception:
                result[part] = {"error": traceback.format_exc()}
            result[part]["wall_s"] = time.perf_counter() - t0
            print(
                f"== {part} ({result[part]['wall_s']:.0f} s)\n{_summary(part, result[part])}",
                flush=True,
            )
            (out / "dep.json").write_text(json.dumps(result, indent=1, default=str))
    failed = [p for p in args.parts.split(",") if "error" in result[p]]
    return 1 if failed else 0


def _run_part(part: str, sizes: Sizes, work: Path, tie_tol: float) -> dict:
    if part == "equality":
        return equality(sizes, work, tie_tol)
    if part == "dispatch":
        ranks = run_ranks(dispatch_worker, 2, sizes, backend=sizes.backend)
        return {
            "hidden": sizes.hidden,
            "top_k": sizes.top_k,
            "experts": sizes.experts,
            "ranks": ranks,
        }
    if part == "decode":
        dep1 = _decode_run(ParallelGroups.single(), sizes)  # this process, device 0
        _free_device_memory(sizes)
        dep2 = run_ranks(decode_worker, 2, sizes, backend=sizes.backend)
        per_gpu = statistics.mean(r["tok_s_per_gpu"] for r in dep2)
        return {
            "dep1": dep1,
            "dep2": dep2,
            "dep2_over_dep1_per_gpu": per_gpu / dep1["tok_s_per_gpu"],
        }
    if part == "eplb":
        return {"ranks": run_ranks(eplb_worker, 2, sizes, backend=sizes.backend)}
    if part == "memory":
        from rackserve.model.quant import weight_memory

        whole = weight_memory(_quantized(_format_config(sizes), torch.device("meta")))
        return {"one_device_counted": whole,
                "ranks": run_ranks(memory_worker, 2, sizes, backend=sizes.backend)}  # fmt: skip
    raise ValueError(f"unknown part {part!r}")  # fmt: skip


def _summary(part: str, r: dict) -> str:
    if "error" in r:
        return r["error"].strip().splitlines()[-1]
    if part == "equality":
        return f"all equal {r['all_equal']}, within bf16 tolerance {r['within_bf16_tolerance']}"
    if part == "dispatch":
        return "\n".join(
            f"T={x['tokens_per_rank']}: dispatch {x['dispatch_us']:.0f} us "
            f"({x['dispatch_gb_per_s']:.1f} GB/s), combine {x['combine_us']:.0f} us"
            for x in r["ranks"][0]
        )
    if part == "decode":
        one, two = r["dep1"], r["dep2"][0]
        return (
            f"DEP1 {one['tok_s_per_gpu']:.0f} tok/s/GPU {one['step_ms']}; DEP2 "
            f"{two['tok_s_per_gpu']:.0f} tok/s/GPU {two['step_ms']}; "
            f"ratio {r['dep2_over_dep1_per_gpu']:.2f}"
        )
    if part == "memory":
        gib = 2**30
        return (
            "; ".join(
                f"rank {x['rank']}: counted {x['counted']['total'] / gib:.1f} GiB"
                + (f", allocated {x['allocated'] / gib:.1f} GiB" if x["allocated"] else "")
                for x in r["ranks"]
            )
            + f"; one device would hold {r['one_device_counted']['total'] / gib:.1f} GiB"
        )
    if part == "eplb":
        x = r["ranks"][0]
        return (
            f"balancedness {min(x['balancedness_before']):.3f} -> "
            f"{min(x['balancedness_after']):.3f} "
            f"(uniform {min(x['balancedness_uniform'] or [0]):.3f}); slowest rearranging step "
            f"{x['slowest_over_median']:.2f}x the median over {x['rearranging_steps']} steps"
        )
    return ""


def _free_device_memory(sizes: Sizes) -> None:
    """Give device 0 back to the ranks: the model and its EP object reference each other."""
    gc.collect()
    if sizes.device == "cuda":
        torch.cuda.empty_cache()


def _device_name(sizes: Sizes) -> str:
    if sizes.device == "cuda":
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
