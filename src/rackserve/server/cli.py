"""``rackserve serve MODEL``: the OpenAI-compatible server, flags named as in ``vllm serve``.

Every option may also come from ``--config file.yaml`` (keys spelled like the flags, with
dashes or underscores); a flag given on the command line wins. Options are registered with
a ``None`` default so "given on the command line" is visible; the real defaults, the YAML
file and what the options build are in ``options.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from rackserve.request import MAX_NUM_LOGPROBS
from rackserve.server.options import (
    DTYPE_CHOICES,
    TOOL_CALL_PARSERS,
    build_engine_config,
    check_block_size,
    load_chat_template,
    parse_bytes,
    parse_count,
    parse_dtype_name,
    preflight,
    resolve_options,
)

STATS_LOG_INTERVAL_S = 10.0  # vLLM's default interval of the periodic stats line


def _with_underscores(*flags: str) -> list[str]:
    """Each flag plus its underscore spelling (``--max_model_len``), as vLLM accepts."""
    names = list(flags)
    for flag in flags:
        if flag.startswith("--") and "-" in flag[2:]:
            names.append("--" + flag[2:].replace("-", "_"))
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("model", nargs="?", help="checkpoint directory (HF format)")

    def add(*flags: str, **kwargs: Any) -> None:
        p.add_argument(*_with_underscores(*flags), **kwargs)

    add("--config", help="YAML file of options (keys as flag names); CLI flags win")
    add("--tokenizer", help="tokenizer directory (default: the model directory)")
    add(
        "--structured-output-timeout-s", type=float,
        help="fail a request whose grammar is still compiling after this (default 30)",
    )  # fmt: skip
    add("--served-model-name", nargs="+", help="name(s) clients use (default: the model path)")
    add("--host", help="bind address (default 127.0.0.1: loopback only)")
    add("--port", type=int, help="port (default 8000)")
    add("--api-key", help="require 'Authorization: Bearer KEY' (health and metrics stay open)")
    add("--max-model-len", type=parse_count, help="context length, e.g. 32k (default: model's)")
    add("--max-num-seqs", type=int, help="most requests in one batch (default 256)")
    add("--max-num-batched-tokens", type=parse_count, help="token budget of one step (8192)")
    add(
        "--long-prefill-token-threshold", type=parse_count,
        help="most tokens of one request a step (default 0: no cap); long prompts then "
        "prefill in chunks, and a P/D prefill engine streams their KV while later chunks run",
    )  # fmt: skip
    add(
        "--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory",
        type=parse_bytes, help="KV cache bytes, e.g. 64M, 20G (default: from the GPU share)",
    )  # fmt: skip
    add(
        "--gpu-memory-utilization", type=float,
        help="fraction of the GPU's total memory this instance may use: weights, "
        "activations and KV cache together (default 0.9)",
    )  # fmt: skip
    add(
        "--kv-cache-dtype", choices=("auto", "fp8"),
        help="auto: the model dtype; fp8: KV rows and indexer keys in e4m3 (CPU and GPU kernels)",
    )  # fmt: skip
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    add(
        "--kv-offload-memory", type=parse_bytes,
        help="host KV pool bytes, e.g. 8G: blocks the KV cache evicts are kept there and "
        "loaded back on a prefix hit (default: no pool)",
    )  # fmt: skip
    add(
        "--kv-offload-server",
        help="share the host KV pool of `rackserve kv-pool` at this ZMQ address instead",
    )
    add("--kv-events-endpoint", help="publish KV events on this ZMQ address (tcp://HOST:PORT)")
    add("--scheduling-policy", choices=("fcfs", "priority"))
    add(
        "--dtype", type=parse_dtype_name, metavar="{" + ",".join(DTYPE_CHOICES) + "}",
        help="auto (float32 on CPU, bfloat16 on GPU), half/float16, bfloat16, float/float32",
    )  # fmt: skip
    add("--device", help="auto, cpu or cuda")
    add("--seed", type=int, help="engine seed (default 0)")
    add("--enforce-eager", action="store_true", default=None, help="no CUDA graphs for decode")
    add(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="schedule step N+1 while step N runs (default: on a GPU where supported, not "
        "with spec decoding or DP/EP)",
    )  # fmt: skip
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
    # vLLM's flags (issue 15)
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help='tool_choice "auto": tool calls parsed from the output (with --tool-call-parser)',
    )
    add("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="the model's tool-call format")
    add("--chat-template", help="chat template: a Jinja file, or the template itself")
    add("--max-logprobs", type=int, help=f"most logprobs per token (<= {MAX_NUM_LOGPROBS})")
    add("--enable-log-requests", action="store_true", default=None, help="log every request")
    add(
        "--disable-log-stats",
        action="store_true",
        default=None,
        help=f"no stats line every {STATS_LOG_INTERVAL_S:g} s",
    )
    add(
        "--block-size",
        type=int,
        help="tokens per KV block. Block sizes here follow from the model (each cache group "
        "pages its own way); what acts like vLLM's block size is the prefix-cache "
        "granularity, the common multiple of all groups' blocks: given, it must equal that",
    )
    add("--metrics-prefix", help="metric name prefix: rackserve (default) or vllm (dashboards)")
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
    add(
        "--kv-transfer-config",
        help='P/D role, JSON as vLLM\'s: \'{"kv_role": "kv_producer", "kv_connector": "tcp", '
        '"kv_port": 14579}\' (kv_consumer / kv_both; kv_load_failure_policy recompute|fail)',
    )
    add(
        "--max-kv-loads-per-step",
        type=int,
        help="decode side: requests admitted with remote KV per step (default 4; 0 = no cap)",
    )
    add(
        "--speculative-config",
        help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "num_speculative_tokens": 3, "model": "DIR"}\'',
    )
    p.set_defaults(func=serve)


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
    if engine_config.parallel.headless:
        from rackserve.engine.dp_process import run_headless

        return run_headless(engine_config)
    # This process only serves: drop the `_created` series, as vLLM's /metrics does.
    prometheus_client.disable_created_metrics()
    preflight(options, engine_config)
    tokenizer = AutoTokenizer.from_pretrained(options["tokenizer"] or options["model"])
    if options["chat_template"]:
        tokenizer.chat_template = load_chat_template(options["chat_template"])
    names = tuple(options["served_model_name"] or [str(options["model"])])
    metrics = ServerMetrics(names[0], prefix=options["metrics_prefix"])
    metrics.set_cache_config_info(
        block_size=check_block_size(options, engine_config.model_config),
        gpu_memory_utilization=engine_config.cache.gpu_memory_utilization,
        kv_cache_memory_bytes=engine_config.cache.kv_cache_memory,
        enable_prefix_caching=engine_config.cache.enable_prefix_caching,
        cache_dtype=engine_config.dtype,
    )
    # Our own loggers (request log, stats line, ignored fields) print like uvicorn's.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
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
        allowed_origins=tuple(options["allowed_origins"] or ()),
        limits=RequestLimits(
            max_sequences_per_request=options["max_sequences_per_request"],
            max_tokens_per_request=options["max_tokens_per_request"],
            trust_request_chat_template=bool(options["trust_request_chat_template"]),
        ),
        auto_tool_parser=options["tool_call_parser"]
        if options["enable_auto_tool_choice"]
        else None,
        max_logprobs=options["max_logprobs"],
        log_requests=bool(options["enable_log_requests"]),
        stats_log_interval_s=None if options["disable_log_stats"] else STATS_LOG_INTERVAL_S,
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
