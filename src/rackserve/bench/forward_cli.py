"""`bench forward` and `bench decode` command lines (heavy imports inside the handlers)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import subprocess
import time
from typing import Any

from rackserve.bench.report import write_json
from rackserve.model.cli import add_quantization_args, quant_config


def _git_commit() -> str:
    """The commit measured: $RACKSERVE_COMMIT when set (a device copy of the tree may carry
    a stale .git), else git's HEAD."""
    if os.environ.get("RACKSERVE_COMMIT"):
        return os.environ["RACKSERVE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _load(args: argparse.Namespace):
    """The model from --model DIR, or a --preset with random weights made on the device."""
    import torch

    from rackserve.device import resolve

    device, dtype = resolve(args.device, args.dtype)
    if args.model:
        from rackserve.model.loader import load_model

        model = load_model(args.model, dtype=dtype, device=device, kernels=_kernels(args))
        return model, str(args.model)
    import dataclasses

    from rackserve.model.create import init_model_
    from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.model.presets import preset_config

    cfg = preset_config(args.preset, args.layers, args.experts)
    quantization = quant_config(args.quantization, args.expert_dtype, args.scale_fmt)
    cfg = dataclasses.replace(cfg, quantization=quantization)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels=_kernels(args))
    init_model_(model.cast(dtype), seed=0)
    stored = "" if quantization is None else f", fp8 + {quantization.expert_dtype} experts"
    return (
        model.eval(),
        f"{args.preset} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts{stored})",
    )


def _kernels(args: argparse.Namespace) -> str:
    """`--impl fast` runs the fast kernels where the device has them; `reference` never."""
    return "auto" if getattr(args, "impl", "fast") == "fast" else "reference"


def _hardware(args: argparse.Namespace, device_type: str) -> str | None:
    if args.hardware:
        return args.hardware
    if device_type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "b200", "b300"):
        if key in name:
            return key
    return None


def _forward(args: argparse.Namespace) -> int:
    import torch

    from rackserve.bench.forward import (
        BatchSpec,
        forward_step,
        isolated_times,
        pipelined_times,
        roofline,
        synthetic_step,
    )
    from rackserve.runner.cuda_graph import graph_serves

    model, model_name = _load(args)
    device = next(model.parameters()).device
    hardware = _hardware(args, device.type)
    records: list[dict[str, Any]] = []
    for spec_text in args.batch:
        spec = BatchSpec.parse(spec_text)
        kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
        synthetic = synthetic_step(model, spec, kv_dtype=kv_dtype)
        graph = (
            args.impl == "fast"
            and not args.enforce_eager
            and device.type == "cuda"
            and graph_serves(synthetic.step.inputs)
        )
        run = forward_step(model, synthetic, graph, args.warmup)
        times = isolated_times(run, args.iters, device)
        measured = statistics.median(times)
        # the same steps back to back (the asynchronous engine's steady state): the device's
        # time per step with the host's staging and launch hidden behind the previous step
        pipelined = pipelined_times(run, args.iters) if device.type == "cuda" else None
        counts = roofline(model, spec, hardware)
        record: dict[str, Any] = {
            "kind": "forward",
            # "reference": every op's plain-torch reference, eager; "fast": the fast kernels
            # where the device has them, a CUDA graph where the runner replays one (the
            # planner calibrates only from "fast" records)
            "implementation": args.impl,
            "cuda_graph": graph,
            "phase": spec.phase,
            "batch": spec_text,
            "num_requests": spec.num_requests,
            "new_tokens": spec.new_tokens,
            "context": spec.context,
            **(
                {"decode_requests": spec.decode_requests, "decode_context": spec.decode_context}
                if spec.phase == "mixed"
                else {}
            ),
            "model": model_name,
            "dtype": str(model.head.weight.dtype).removeprefix("torch."),
            "kv_cache_dtype": args.kv_cache_dtype,
            "device": torch_device_name(device),
            "gpu": counts.get("hardware"),
            "measured_s": measured,
            "min_s": min(times),
            "iters": len(times),
            **({} if pipelined is None else {"pipelined_s": statistics.median(pipelined)}),
            "flops": counts["flops"],
            "bytes": counts["bytes"],
            "date": datetime.date.today().isoformat(),
            "commit": _git_commit(),
        }
        line = (
            f"{spec_text}: median {measured * 1e3:.3f} ms over {len(times)} runs; "
            f"{counts['flops'] / 1e9:.2f} GFLOP, {counts['bytes'] / 1e9:.3f} GB"
        )
        if "roofline_s" in counts:
            record["roofline_s"] = counts["roofline_s"]
            record["fraction_of_roofline"] = counts["roofline_s"] / measured
            line += (
                f"; roofline {counts['roofline_s'] * 1e3:.3f} ms on {counts['hardware']} "
                f"({100 * record['fraction_of_roofline']:.1f}% of roofline)"
            )
            if pipelined is not None:
                record["pipelined_fraction"] = counts["roofline_s"] / record["pipelined_s"]
        if pipelined is not None:
            line += f"; back to back {record['pipelined_s'] * 1e3:.3f} ms"
        print(line, flush=True)
        records.append(record)
    if args.output:
        write_json(records, args.output)
    return 0


def torch_device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _decode(args: argparse.Namespace) -> int:
    """Engine steps at a fixed decode concurrency: step time vs the forward inside it."""
    from rackserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpecConfig,
    )
    from rackserve.engine.core import EngineCore
    from rackserve.engine.outputs import EngineCoreRequest
    from rackserve.request import SamplingParams

    spec = SpecConfig.from_json(args.speculative_config)
    per_step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    profiled = _PROFILE_STEPS if args.profile else 0
    total = args.context + (args.warmup + args.steps + profiled) * per_step + 2
    config = EngineConfig(
        model=str(args.model),
        model_config=ModelConfig.from_pretrained(args.model),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=max(args.max_num_batched_tokens, args.concurrency),
            max_model_len=total,
            async_scheduling=args.async_scheduling,
        ),
        dtype=args.dtype or "auto",
        device=args.device or "auto",
        speculative=spec,
    )
    core = EngineCore(config)
    params = SamplingParams(temperature=0, max_tokens=total - args.context, ignore_eos=True)
    vocab = core.model.cfg.vocab_size
    # Synthetic contexts: blocks are allocated and the KV is whatever the cache holds (as a
    # P/D decode instance admits pushed KV); nothing is prefilled. A salt per request keeps
    # these never-computed blocks out of anyone's prefix hits.
    for i in range(args.concurrency):
        prompt = [(i * 7919 + t) % (vocab - 2) + 2 for t in range(args.context)]
        request = EngineCoreRequest(f"d{i}", prompt, params, time.time(), cache_salt=f"d{i}")
        if not core.add_request_with_kv(request, args.context - 1):
            raise ValueError(
                f"the KV cache cannot hold {args.concurrency} x {args.context} tokens: "
                "raise --kv-cache-memory or lower --concurrency / --context"
            )
    # per step: wall time of step(), and the forward inside it (device time by CUDA events on
    # a GPU; with --async-scheduling the forward of the step collected in that call)
    step_times, forward_times, propose_times = [], [], []
    num_output = 0
    spec_then = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            spec_then = core.scheduler.stats().spec_decoding
        start = time.perf_counter()
        out = core.step()
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            step_times.append(elapsed)
            forward_times.append(core.last_forward_time_s)
            propose_times.append(core.last_propose_time_s)
            num_output += sum(len(o.new_token_ids) for o in out.outputs)
    step_ms = statistics.median(step_times) * 1e3
    forward_ms = statistics.median(forward_times) * 1e3
    # the host time not hidden behind the device: the issue-14 gate (<= 0.3 ms at 256)
    minus = [(s - f) * 1e3 for s, f in zip(step_times, forward_times, strict=True)]
    result = {
        "kind": "decode",
        "concurrency": args.concurrency,
        "context": args.context,
        "median_step_ms": step_ms,
        "median_forward_ms": forward_ms,
        "overhead_ms": step_ms - forward_ms,
        "async_scheduling": core.async_scheduling,
        "median_step_minus_forward_ms": statistics.median(minus),
        "p90_step_minus_forward_ms": sorted(minus)[int(0.9 * (len(minus) - 1))],
        "output_tokens_per_s": args.concurrency / (step_ms / 1e3),
        # measured: tokens emitted per request per step (1 without speculation)
        "output_tokens_per_step": num_output / max(len(step_times), 1) / args.concurrency,
        "date": datetime.date.today().isoformat(),
        "commit": _git_commit(),
    }
    spec_now = core.scheduler.stats().spec_decoding
    if spec is not None and spec_now is not None and spec_then is not None:
        result["speculative_config"] = {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
        result |= spec_now.minus(spec_then).report()
        result["output_tokens_per_s"] = num_output / sum(step_times)
        # the drafter's device work behind each verify (0 where the host proposed): the
        # host time left exposed is the step minus both
        propose_ms = statistics.median(propose_times) * 1e3
        result["median_propose_ms"] = propose_ms
        exposed = [m - p * 1e3 for m, p in zip(minus, propose_times, strict=True)]
        result["median_step_minus_device_ms"] = statistics.median(exposed)
    print(
        f"decode x{args.concurrency} @ {args.context}: step {step_ms:.2f} ms, forward "
        f"{forward_ms:.2f} ms, overhead {step_ms - forward_ms:.2f} ms, step minus forward "
        f"{result['median_step_minus_forward_ms']:.2f} ms per step "
        f"({result['output_tokens_per_s']:.0f} tok/s{', async' if core.async_scheduling else ''})"
        + (
            f"; proposal on the device {result['median_propose_ms']:.2f} ms, step minus "
            f"both {result['median_step_minus_device_ms']:.2f} ms"
            if "median_propose_ms" in result
            else ""
        )
    )
    if args.profile:
        _profile_steps(core, profiled, args.profile)
    if args.output:
        write_json(result, args.output)
    return 0


_PROFILE_STEPS = 5


def _profile_steps(core: Any, steps: int, path: str) -> None:
    """``steps`` more engine steps under cProfile (where the host time goes) and then
    torch.profiler (kernels and torch ops per step); both tables as text into ``path``."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from rackserve.engine import step_phases

    half = max(1, steps // 2)
    host = cProfile.Profile()
    host.enable()
    for _ in range(half):
        core.step()
    host.disable()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    step_phases.record(True)
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps - half):
                with record_function(_STEP_RANGE):
                    core.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        step_phases.record(False)
    text = io.StringIO()
    text.write(f"== cProfile over {half} engine steps (cumulative)\n")
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
    text.write(f"== torch.profiler over {steps - half} engine steps\n")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text.write(prof.key_averages().table(sort_by=sort, row_limit=50, max_name_column_width=90))
    text.write(prof.key_averages().table(sort_by="count", row_limit=30, max_name_column_width=90))
    text.write(
        "== device timeline of those steps but the first, which carries the profiler's start "
        "(kernel_timeline.py)\n"
    )
    text.write(_timelines(prof))
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"profile of {steps} steps in {path}")


_STEP_RANGE = "rackserve.engine_step"


def _timelines(prof: Any) -> str:
    """Each profiled step's wall, kernel and idle time and its largest idle gaps (from the
    second step on: the first one's host time includes the profiler's start)."""
    from torch.autograd import DeviceType

    from rackserve.bench.kernel_timeline import Span, format_timelines, step_timelines
    from rackserve.engine.step_phases import PREFIX

    steps, kernels, phases = [], [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        host = e.device_type == DeviceType.CPU  # a range's GPU annotation is no kernel
        if e.name == _STEP_RANGE:
            if host:
                steps.append(span)
        elif e.name.startswith(PREFIX):
            if host:
                phases.append(Span(*span, e.name.removeprefix(PREFIX)))
        elif e.device_type == DeviceType.CUDA:
            kernels.append(Span(*span, e.name))
    timelines = step_timelines(sorted(steps)[1:], kernels, phases=phases)
    if not kernels:  # each step one idle gap, its whole window: only the host phases say more
        timelines = [dataclasses.replace(t, gaps=()) for t in timelines]
        return "no device kernels (CPU run)\n" + format_timelines(timelines)
    return format_timelines(timelines)


def _model_args(p: argparse.ArgumentParser, allow_preset: bool) -> None:
    p.add_argument("--model", required=not allow_preset, help="checkpoint directory")
    if allow_preset:
        p.add_argument("--preset", default="v4-flash", help="random weights when no --model")
        p.add_argument("--layers", type=int, default=None)
        p.add_argument("--experts", type=int, default=None)
        add_quantization_args(p)  # random weights made quantized on the device
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--output", default=None, help="JSON result file")


def register_forward(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "forward", help="time the model forward for an exact synthetic batch"
    )
    _model_args(p, allow_preset=True)
    p.add_argument(
        "--batch",
        action="append",
        required=True,
        help="prefill:TOKENS[@CONTEXT], decode:REQS@CONTEXT[xTOKENS] or "
        "mixed:TOKENS[@CONTEXT]+REQS@CONTEXT (a prefill chunk and decodes in one step); "
        "repeatable",
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hardware", default=None, help="roofline GPU (default: detected)")
    p.add_argument(
        "--impl",
        choices=("fast", "reference"),
        default="fast",
        help="fast: fast kernels + CUDA graphs (decode; steps of up to 2048 tokens) on a GPU; "
        "reference: plain-torch ops, eager",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graph (fast kernels)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: window rows, compressed entries and indexer keys in e4m3 (as the server)",
    )
    p.set_defaults(func=_forward)


def register_decode(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "decode", help="engine decode steps at a concurrency: step time vs forward time"
    )
    _model_args(p, allow_preset=False)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    p.add_argument(
        "--speculative-config",
        default=None,
        help='JSON as serve\'s, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'',
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while N runs (default: as serve, on a GPU where supported)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help=f"after the measured steps, {_PROFILE_STEPS} more under cProfile and torch.profiler "
        "(host functions, kernels, torch ops, and each step's device idle time with its "
        "largest gaps): text into FILE",
    )
    p.set_defaults(func=_decode)
