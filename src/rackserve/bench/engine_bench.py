"""Engine-side benchmarks: `bench scheduler` (CPU overhead per step, no model) and
`bench throughput` (offline tokens/s through the LLM API)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from rackserve.bench.report import write_json


def scheduler_step_times(
    num_requests: int, context: int, num_steps: int, preset: str = "v4-flash"
) -> dict[str, float]:
    """Time schedule + input preparation + update per decode step with ``num_requests``
    running requests of ``context`` tokens; the runner is synthetic (samples token 7)."""
    # Imported here: building the `bench` parser must not pull in torch.
    from rackserve.config import SchedulerConfig
    from rackserve.engine.outputs import RunnerOutput
    from rackserve.engine.scheduler import Scheduler
    from rackserve.kv.manager import KVCacheManager
    from rackserve.kv.spec import cache_groups_for
    from rackserve.model.presets import preset_config
    from rackserve.request import Request, SamplingParams
    from rackserve.runner.input_batch import InputBatch

    cfg = preset_config(preset, num_layers=4, num_experts=8)
    groups = cache_groups_for(cfg)
    budget = max(8192, num_requests)
    # early requests decode while later ones prefill: leave room for all of those steps
    max_len = context + num_requests * context // budget + num_steps + 16
    blocks = {g.name: num_requests * (max_len // g.block_tokens + 2) + 1 for g in groups}
    kv = KVCacheManager(groups, blocks)
    config = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
    )
    sched = Scheduler(config, kv, cfg.eos_token_id)
    batch = InputBatch(
        {g.name: g.block_tokens for g in groups},
        num_requests,
        max_len,
        cfg.vocab_size,
        cfg.eos_token_id,
        "cpu",
    )
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_len, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + t) % 50000 + 2 for t in range(context)]
        sched.add_request(Request(f"r{i}", prompt, params, cfg.eos_token_id, arrival_time=0.0))

    def step() -> tuple[tuple[float, float, float], bool]:
        """One step; times schedule, input preparation and update, not the runner's work."""
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        prepared = batch.prepare(out)
        t2 = time.perf_counter()
        assert prepared is not None
        # the synthetic runner (stands for the GPU): one token per request that samples
        sampled = [[7] if s else [] for s in prepared.inputs.sample_mask]
        for r, tokens in zip(prepared.reqs, sampled, strict=True):
            r.token_ids.extend(tokens)
        result = RunnerOutput([r.req_id for r in prepared.reqs], sampled)
        t3 = time.perf_counter()
        sched.update(out, result)
        t4 = time.perf_counter()
        decode = all(n == 1 for n in out.num_scheduled_tokens.values())
        return (t1 - t0, t2 - t1, t4 - t3), decode and len(out.num_scheduled_tokens) == num_requests

    while not step()[1]:  # prefill every request first (not timed)
        pass
    phases = [step()[0] for _ in range(num_steps)]
    times = [sum(p) for p in phases]
    return {
        "num_requests": num_requests,
        "context": context,
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        "schedule_ms": statistics.median(p[0] for p in phases) * 1e3,
        "prepare_ms": statistics.median(p[1] for p in phases) * 1e3,
        "update_ms": statistics.median(p[2] for p in phases) * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
    }


def _scheduler(args: argparse.Namespace) -> int:
    results = [scheduler_step_times(n, args.context, args.steps) for n in args.num_requests]
    for r in results:
        print(
            f"{r['num_requests']:>6} running decode requests @ {r['context']} tokens: "
            f"median {r['median_ms']:.3f} ms, p90 {r['p90_ms']:.3f} ms per step "
            f"(schedule {r['schedule_ms']:.3f} + input preparation {r['prepare_ms']:.3f} + "
            f"update {r['update_ms']:.3f} ms; the synthetic runner is not timed)"
        )
    if args.output:
        write_json(results, args.output)
    return 0


def _throughput(args: argparse.Namespace) -> int:
    import random

    from rackserve.llm import LLM
    from rackserve.request import SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    rng = random.Random(args.seed)
    vocab = min(llm.engine.model.cfg.vocab_size, len(llm.tokenizer))
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = args.num_prompts * args.input_len
    result: dict[str, Any] = {
        "elapsed_s": elapsed,
        "num_requests": args.num_prompts,
        "requests_per_s": args.num_prompts / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s"
    )
    if args.output:
        write_json(result, args.output)
    return 0


def register_scheduler(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "scheduler", help="CPU time of schedule + input preparation + update per step"
    )
    p.add_argument(
        "--num-requests",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[256, 1024],
        help="running decode requests, comma-separated (default 256,1024)",
    )
    p.add_argument("--context", type=int, default=2048, help="tokens per request")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps")
    p.add_argument("--output", default=None, help="JSON result file")
    p.set_defaults(func=_scheduler)


def register_throughput(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("throughput", help="offline tokens/s through the LLM API")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON result file")
    p.set_defaults(func=_throughput)
