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
    "shutdown_timeout": 30.0,
    "engine_dead_exit_delay": 2.0,
    "engine_startup_timeout": 600.0,
    "max_request_body_bytes": 32 << 20,
    "uvicorn_log_level": "info",
    "disable_uvicorn_access_log": False,
    "engine_core_factory": "rackserve.engine.core:EngineCore",
    # reliability and security (docs/reliability.md)
    "allowed_origins": None,
    "max_sequences_per_request": 256,
    "max_tokens_per_request": None,
    "trust_request_chat_template": False,
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
    add("--shutdown-timeout", type=float, help="SIGTERM: seconds to drain requests (30)")
    add("--engine-dead-exit-delay", type=float, help="seconds from engine death to exit (2)")
    add("--engine-startup-timeout", type=float, help="seconds to load the model (600)")
    add("--max-request-body-bytes", type=parse_bytes, help="413 above this (default 32M)")
    add("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug"))
    add("--disable-uvicorn-access-log", action="store_true", default=None)
    add("--engine-core-factory", help="'module:callable' building the engine core (testing)")
    add("--allowed-origins", nargs="+", help="browser origins allowed (CORS); default none")
    add("--max-sequences-per-request", type=int, help="most prompts x n in a request (256)")
    add("--max-tokens-per-request", type=int, help="cap on max_tokens (default: the context)")
    add(
        "--trust-request-chat-template",
        action="store_true",
        default=None,
        help="let requests pass their own Jinja chat_template (off: it runs arbitrary Jinja)",
    )
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
    from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

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
        served_model_name=names[0] if names else None,
    )


def check_tokenizer_dir(path: str | Path) -> None:
    """ValueError naming the missing file unless ``path`` holds a tokenizer that
    transformers can load without extra packages (otherwise it talks of sentencepiece)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"tokenizer directory {directory} not found: pass --tokenizer DIR")
    if (
        not (directory / "tokenizer.json").exists()
        and not (directory / "tokenizer_config.json").exists()
    ):
        raise ValueError(
            f"{directory} has no tokenizer.json (nor tokenizer_config.json): copy the "
            "checkpoint's tokenizer files there or pass --tokenizer DIR"
        )


def preflight(options: dict[str, Any], engine_config: Any) -> None:
    """Every check that can fail on the operator's input, in one line each, before any
    process starts: the checkpoint's config, shards and tensor shapes, the KV budget, the
    tokenizer files."""
    from rackserve.model.loader import check_checkpoint

    check_checkpoint(options["model"])
    if engine_config.cache.kv_cache_memory is not None:
        from rackserve.device import resolve
        from rackserve.engine.core import plan_kv_cache

        _, dtype = resolve(engine_config.device, engine_config.dtype)
        plan_kv_cache(engine_config, dtype, engine_config.cache.kv_cache_memory)
    check_tokenizer_dir(options["tokenizer"] or options["model"])


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT (exit 0) or engine death (exit 1)."""
    import prometheus_client
    import uvicorn
    from transformers import AutoTokenizer

    from rackserve.server.api import ServerSettings, build_app
    from rackserve.server.async_client import (
        AsyncEngineClient,
        EngineDeadError,
        ServerShutdownError,
    )
    from rackserve.server.drain import DrainingServer
    from rackserve.server.limits import RequestLimits
    from rackserve.server.metrics import ServerMetrics

    options = resolve_options(args)
    engine_config = build_engine_config(options)
    # This process only serves: drop the `_created` series, as vLLM's /metrics does.
    prometheus_client.disable_created_metrics()
    preflight(options, engine_config)
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

    client = AsyncEngineClient(
        engine_config,
        tokenizer,
        core_factory=options["engine_core_factory"],
        metrics=metrics,
        on_engine_dead=on_engine_dead,
        startup_timeout_s=options["engine_startup_timeout"],
    )
    settings = ServerSettings(
        served_model_names=names,
        model_path=str(options["model"]),
        api_key=options["api_key"],
        max_request_body_bytes=options["max_request_body_bytes"],
        allowed_origins=tuple(options["allowed_origins"] or ()),
        limits=RequestLimits(
            max_sequences_per_request=options["max_sequences_per_request"],
            max_tokens_per_request=options["max_tokens_per_request"],
            trust_request_chat_template=bool(options["trust_request_chat_template"]),
        ),
    )
    app = build_app(client, tokenizer, metrics, settings)
    config = uvicorn.Config(
        app,
        host=options["host"],
        port=options["port"],
        log_level=options["uvicorn_log_level"],
        access_log=not options["disable_uvicorn_access_log"],
        timeout_keep_alive=5,
    )

    def drain_expired() -> None:
        timeout = options["shutdown_timeout"]
        print(f"rackserve: requests still running after {timeout:g} s; ending them", flush=True)
        client.fail_all_requests(ServerShutdownError("shutdown timeout"))

    server = DrainingServer(config, options["shutdown_timeout"], drain_expired)
    server_box.append(server)

    async def main() -> bool:
        # The engine starts before uvicorn, so a start-up failure is one line here rather
        # than a lifespan traceback (the app's lifespan skips a started client).
        try:
            await client.start()
        except EngineDeadError as e:
            last = [line for line in str(e).splitlines() if line.strip()][-1:]
            print(f"rackserve serve: error: {' '.join(last)}", file=sys.stderr)
            return False
        # uvicorn re-raises the signal that stopped it once it has drained; a no-op handler
        # turns that into a normal return, so a SIGTERM drain ends with exit code 0.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, frame: None)
        await server.serve()
        return True

    if not asyncio.run(main()):
        return 1
    if outcome["engine_dead"]:
        return 1
    if not server.started:
        print("rackserve serve: the server did not start (see the log above)", file=sys.stderr)
        return 1
    return 0
