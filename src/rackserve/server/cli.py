"""``rackserve serve MODEL``: the OpenAI-compatible server, flags named as in ``vllm serve``.

Every option may also come from ``--config file.yaml`` (keys spelled like the flags, with
dashes or underscores); a flag given on the command line wins. Options are registered with
a ``None`` default so "given on the command line" is visible; the real defaults are in
``SERVE_DEFAULTS``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

SERVE_DEFAULTS: dict[str, Any] = {
    "model": None,
    "tokenizer": None,
    "served_model_name": None,
    "host": "127.0.0.1",
    "port": 8000,
    "api_key": None,
    "max_model_len": None,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "kv_cache_memory": None,
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": True,
    "scheduling_policy": "fcfs",
    "dtype": "auto",
    "device": "auto",
    "seed": 0,
    "enforce_eager": False,
    "shutdown_timeout": 30.0,
    "engine_dead_exit_delay": 2.0,
    "engine_startup_timeout": 600.0,
    "max_request_body_bytes": 32 << 20,
    "uvicorn_log_level": "info",
    "disable_uvicorn_access_log": False,
    "engine_core_factory": "rackserve.engine.core:EngineCore",
    # data parallel + expert parallel (docs/expert_parallel.md)
    "data_parallel_size": 1,
    "data_parallel_size_local": None,
    "data_parallel_start_rank": 0,
    "data_parallel_address": "127.0.0.1",
    "data_parallel_rpc_port": None,
    "headless": False,
    "enable_expert_parallel": False,
    "num_redundant_experts": 0,
    "enable_eplb": False,
    "eplb_config": None,
    "skewed_routing": 0.0,
    "dp_assignment_policy": "least_load",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")


def parse_bytes(text: str | int) -> int:
    """``1073741824``, ``512M``, ``1G``, ``1.5GiB`` -> bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512M, 2G)")
    unit = (match.group(2) or "b")[0].lower()
    return int(float(match.group(1)) * 1024 ** "bkmgt".index(unit))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("model", nargs="?", help="checkpoint directory (HF format)")
    add = p.add_argument
    add("--config", help="YAML file of options (keys as flag names); CLI flags win")
    add("--tokenizer", help="tokenizer directory (default: the model directory)")
    add("--served-model-name", nargs="+", help="name(s) clients use (default: the model path)")
    add("--host", help="bind address (default 127.0.0.1: loopback only)")
    add("--port", type=int, help="port (default 8000)")
    add("--api-key", help="require 'Authorization: Bearer KEY' (health and metrics stay open)")
    add("--max-model-len", type=int, help="context length (default: the model's)")
    add("--max-num-seqs", type=int, help="most requests in one batch (default 256)")
    add("--max-num-batched-tokens", type=int, help="token budget of one step (default 8192)")
    add("--kv-cache-memory", type=parse_bytes, help="KV cache bytes, e.g. 64M, 20G")
    add("--gpu-memory-utilization", type=float, help="fraction of free memory (default 0.9)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    add("--scheduling-policy", choices=("fcfs", "priority"))
    add("--dtype", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16")
    add("--device", help="auto, cpu or cuda")
    add("--seed", type=int, help="engine seed (default 0)")
    add("--enforce-eager", action="store_true", default=None, help="no CUDA graphs for decode")
    add("--shutdown-timeout", type=float, help="SIGTERM: seconds to drain requests (30)")
    add("--engine-dead-exit-delay", type=float, help="seconds from engine death to exit (2)")
    add("--engine-startup-timeout", type=float, help="seconds to load the model (600)")
    add("--max-request-body-bytes", type=parse_bytes, help="413 above this (default 32M)")
    add("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug"))
    add("--disable-uvicorn-access-log", action="store_true", default=None)
    add("--engine-core-factory", help="'module:callable' building the engine core (testing)")
    add("--data-parallel-size", "-dp", type=int, help="DP engine ranks (default 1)")
    add("--data-parallel-size-local", type=int, help="DP ranks on this host (default: all)")
    add("--data-parallel-start-rank", type=int, help="first DP rank of a --headless host")
    add("--data-parallel-address", help="the head host's address (default 127.0.0.1)")
    add("--data-parallel-rpc-port", type=int, help="head port; the next 2 + 2N ports too")
    add("--headless", action="store_true", default=None, help="engine ranks only, no API")
    add("--enable-expert-parallel", action="store_true", default=None, help="EP over DP ranks")
    add("--num-redundant-experts", type=int, help="extra expert slots per layer (default 0)")
    add("--enable-eplb", action="store_true", default=None, help="expert-parallel balancer")
    add("--eplb-config", help='JSON, e.g. \'{"window_size":1000,"step_interval":3000}\'')
    add("--skewed-routing", type=float, help="test models: Zipf exponent of expert popularity")
    add("--dp-assignment-policy", choices=("least_load", "round_robin"))
    p.set_defaults(func=serve)


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the YAML file, then flags given on the command line."""
    options = dict(SERVE_DEFAULTS)
    if args.config:
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: expected a mapping of option: value")
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            if name not in options:
                raise ValueError(f"{args.config}: unknown option {key!r}")
            if name in ("kv_cache_memory", "max_request_body_bytes") and value is not None:
                value = parse_bytes(value)
            options[name] = value
    for name in options:
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    if not options["model"]:
        raise ValueError("no model given: `rackserve serve MODEL_DIR` (or `model:` in --config)")
    names = options["served_model_name"]
    if isinstance(names, str):
        options["served_model_name"] = [names]
    return options


def build_engine_config(options: dict[str, Any]) -> Any:
    from rackserve.config import (
        CacheConfig,
        EngineConfig,
        EPLBConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    model_config = ModelConfig.from_pretrained(options["model"])
    max_model_len = options["max_model_len"] or model_config.max_position_embeddings
    names = options["served_model_name"]
    return EngineConfig(
        model=str(options["model"]),
        model_config=model_config,
        cache=CacheConfig(
            kv_cache_memory=options["kv_cache_memory"],
            gpu_memory_utilization=options["gpu_memory_utilization"],
            enable_prefix_caching=options["enable_prefix_caching"],
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=options["max_num_seqs"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
            max_model_len=max_model_len,
            policy=options["scheduling_policy"],
        ),
        dtype=options["dtype"],
        device=options["device"],
        seed=options["seed"],
        enforce_eager=options["enforce_eager"],
        served_model_name=names[0] if names else None,
        parallel=ParallelConfig(
            data_parallel_size=options["data_parallel_size"],
            data_parallel_size_local=options["data_parallel_size_local"],
            data_parallel_start_rank=options["data_parallel_start_rank"],
            data_parallel_address=options["data_parallel_address"],
            data_parallel_rpc_port=options["data_parallel_rpc_port"],
            headless=options["headless"],
            enable_expert_parallel=options["enable_expert_parallel"],
            num_redundant_experts=options["num_redundant_experts"],
            enable_eplb=options["enable_eplb"],
            eplb=EPLBConfig.from_json(options["eplb_config"]),
            skewed_routing=options["skewed_routing"],
        ),
    )


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT (exit 0) or engine death (exit 1)."""
    import prometheus_client
    import uvicorn
    from transformers import AutoTokenizer

    from rackserve.server.api import ServerSettings, build_app
    from rackserve.server.async_client import AsyncEngineClient
    from rackserve.server.metrics import ServerMetrics

    options = resolve_options(args)
    engine_config = build_engine_config(options)
    if engine_config.parallel.headless:
        from rackserve.engine.dp_process import run_headless

        return run_headless(engine_config)
    # This process only serves: drop the `_created` series, as vLLM's /metrics does.
    prometheus_client.disable_created_metrics()
    if engine_config.cache.kv_cache_memory is not None:
        # Fail in one line before any process starts when the budget cannot work.
        from rackserve.device import resolve
        from rackserve.engine.core import plan_kv_cache

        _, dtype = resolve(engine_config.device, engine_config.dtype)
        plan_kv_cache(engine_config, dtype, engine_config.cache.kv_cache_memory)
    tokenizer = AutoTokenizer.from_pretrained(options["tokenizer"] or options["model"])
    names = tuple(options["served_model_name"] or [str(options["model"])])
    metrics = ServerMetrics(names[0])
    outcome = {"engine_dead": False}
    server_box: list[uvicorn.Server] = []

    def on_engine_dead() -> None:
        # In-flight requests already got their 500; /health answers 503 until we exit.
        outcome["engine_dead"] = True
        delay = options["engine_dead_exit_delay"]
        print(f"rackserve: engine core died; exiting in {delay:g} s", file=sys.stderr)

        def stop() -> None:
            server_box[0].should_exit = True

        asyncio.get_running_loop().call_later(delay, stop)

    client_kwargs: dict[str, Any] = {}
    if engine_config.parallel.data_parallel_size > 1:
        from rackserve.engine.dp_client import DPAsyncEngineClient as AsyncEngineClient

        client_kwargs["assignment_policy"] = options["dp_assignment_policy"]
    client = AsyncEngineClient(
        engine_config,
        tokenizer,
        core_factory=options["engine_core_factory"],
        metrics=metrics,
        on_engine_dead=on_engine_dead,
        startup_timeout_s=options["engine_startup_timeout"],
        **client_kwargs,
    )
    settings = ServerSettings(
        served_model_names=names,
        model_path=str(options["model"]),
        api_key=options["api_key"],
        max_request_body_bytes=options["max_request_body_bytes"],
    )
    app = build_app(client, tokenizer, metrics, settings)
    config = uvicorn.Config(
        app,
        host=options["host"],
        port=options["port"],
        log_level=options["uvicorn_log_level"],
        access_log=not options["disable_uvicorn_access_log"],
        timeout_graceful_shutdown=options["shutdown_timeout"],
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    server_box.append(server)
    # uvicorn re-raises the signal that stopped it once it has drained; a no-op handler
    # turns that into a normal return, so a SIGTERM drain ends with exit code 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: None)
    server.run()
    if outcome["engine_dead"]:
        return 1
    if not server.started:
        print("rackserve serve: the server did not start (see the log above)", file=sys.stderr)
        return 1
    return 0
