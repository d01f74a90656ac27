"""``rackserve serve MODEL``: the OpenAI-compatible server, flags named as in ``vllm serve``.

Every option may also come from ``--config file.yaml`` (keys spelled like the flags, with
dashes or underscores); a flag given on the command line wins. Options are registered with
a ``None`` default so "given on the command line" is visible; the real defaults are in
``SERVE_DEFAULTS``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from rackserve.request import MAX_NUM_LOGPROBS

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
    "long_prefill_token_threshold": 0,
    "kv_cache_memory": None,
    "kv_cache_dtype": "auto",
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": True,
    # the host KV pool and KV events (kv/offload, kv/events.py)
    "kv_offload_memory": None,
    "kv_offload_server": None,
    "kv_events_endpoint": None,
    "scheduling_policy": "fcfs",
    "dtype": "auto",
    "device": "auto",
    "seed": 0,
    "enforce_eager": False,
    "async_scheduling": False,
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
    # vLLM's flags (issue 15)
    "enable_auto_tool_choice": False,
    "tool_call_parser": None,
    "chat_template": None,
    "max_logprobs": MAX_NUM_LOGPROBS,
    "enable_log_requests": False,
    "disable_log_stats": False,
    "block_size": None,
    # P/D disaggregation (disagg/, docs/disaggregation.md)
    "kv_transfer_config": None,
    "max_kv_loads_per_step": None,
    "metrics_prefix": "rackserve",
    "structured_output_timeout_s": 30.0,
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
    "speculative_config": None,
}
# Older spellings still accepted (flags and YAML keys) -> the option they set.
OPTION_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
# --dtype as `vllm serve` spells it -> our dtype names
DTYPE_CHOICES = {
    "auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
    "float": "float32", "float32": "float32",
}  # fmt: skip
TOOL_CALL_PARSERS = ("deepseek_v4",)
STATS_LOG_INTERVAL_S = 10.0  # vLLM's default interval of the periodic stats line
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


_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*$")


def parse_count(text: str | int) -> int:
    """A token count as vLLM reads one: ``8192``, ``32k`` (32000), ``32K`` (32768), ``1M``
    (1048576), ``1m`` (10**6): lower case is decimal, upper case binary."""
    if isinstance(text, int):
        return text
    match = _COUNT.match(str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 8192, 32k, 32K, 1M)")
    number, unit = match.group(1), match.group(2)
    if not unit:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
        return int(number)
    if unit.islower():
        return int(float(number) * 1000 ** ("kmgt".index(unit) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"binary multiples take whole numbers: {text!r}")
    return int(number) * 1024 ** ("KMGT".index(unit) + 1)


def parse_dtype_name(text: str) -> str:
    """``--dtype``: vLLM's names, refused at parse time when unknown."""
    if text not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid dtype {text!r}; choose one of {', '.join(DTYPE_CHOICES)}"
        )
    return DTYPE_CHOICES[text]


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
        "--async-scheduling", action="store_true", default=None,
        help="schedule step N+1 while step N runs (no spec decoding, no DP/EP)",
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


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the YAML file, then flags given on the command line."""
    options = dict(SERVE_DEFAULTS)
    if args.config:
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: expected a mapping of option: value")
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            name = OPTION_ALIASES.get(name, name)
            if name not in options:
                raise ValueError(f"{args.config}: unknown option {key!r}")
            bytes_options = ("kv_cache_memory", "kv_offload_memory", "max_request_body_bytes")
            if name in bytes_options and value is not None:
                value = parse_bytes(value)
            counts = ("max_model_len", "max_num_batched_tokens", "long_prefill_token_threshold")
            if name in counts and value is not None:
                value = parse_count(value)
            if name == "dtype" and value is not None:
                value = _config_value(args.config, key, parse_dtype_name, value)
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
    check_vllm_options(options)
    return options


def _config_value(path: str, key: Any, parse: Any, value: Any) -> Any:
    try:
        return parse(str(value))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{path}: {key}: {e}") from None


def check_vllm_options(options: dict[str, Any]) -> None:
    """The flag combinations `vllm serve` refuses, refused the same way (one line)."""
    if options["enable_auto_tool_choice"] and not options["tool_call_parser"]:
        raise ValueError(
            "--enable-auto-tool-choice requires --tool-call-parser (one of: "
            + ", ".join(TOOL_CALL_PARSERS) + ")"
        )  # fmt: skip
    if options["tool_call_parser"] not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(f"unknown --tool-call-parser {options['tool_call_parser']!r}")
    if not 0 <= options["max_logprobs"] <= MAX_NUM_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_NUM_LOGPROBS}]")
    if options["metrics_prefix"] not in ("rackserve", "vllm"):
        raise ValueError("--metrics-prefix must be 'rackserve' or 'vllm'")


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the argument itself when it is a template."""
    path = Path(value)
    if any(mark in value for mark in ("{{", "{%")):
        return value
    if not path.is_file():
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return path.read_text(encoding="utf-8")


def check_block_size(options: dict[str, Any], model_config: Any) -> int:
    """The prefix-cache granularity (tokens); ``--block-size`` must name it if given."""
    from rackserve.kv.spec import cache_groups_for, prefix_alignment

    granularity = prefix_alignment(cache_groups_for(model_config))
    given = options["block_size"]
    if given is not None and given != granularity:
        raise ValueError(
            f"--block-size {given}: this model's KV blocks are set by its cache groups; "
            f"prefix hits come in multiples of {granularity} tokens. Give --block-size "
            f"{granularity} or leave it out"
        )
    return granularity


def build_engine_config(options: dict[str, Any]) -> Any:
    from rackserve.config import (
        CacheConfig,
        DisaggConfig,
        EngineConfig,
        EPLBConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpecConfig,
    )

    model_config = ModelConfig.from_pretrained(options["model"])
    check_block_size(options, model_config)
    max_model_len = options["max_model_len"] or model_config.max_position_embeddings
    names = options["served_model_name"]
    return EngineConfig(
        model=str(options["model"]),
        model_config=model_config,
        cache=CacheConfig(
            kv_cache_memory=options["kv_cache_memory"],
            gpu_memory_utilization=options["gpu_memory_utilization"],
            enable_prefix_caching=options["enable_prefix_caching"],
            kv_cache_dtype=options["kv_cache_dtype"],
            kv_offload_memory=options["kv_offload_memory"],
            kv_offload_server=options["kv_offload_server"],
            kv_events_endpoint=options["kv_events_endpoint"],
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=options["max_num_seqs"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
            long_prefill_token_threshold=options["long_prefill_token_threshold"],
            max_model_len=max_model_len,
            policy=options["scheduling_policy"],
            async_scheduling=options["async_scheduling"],
        ),
        dtype=options["dtype"],
        device=options["device"],
        seed=options["seed"],
        enforce_eager=options["enforce_eager"],
        tokenizer=options["tokenizer"],
        structured_output_timeout_s=options["structured_output_timeout_s"],
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
        kv_transfer=DisaggConfig.from_json(
            options["kv_transfer_config"], options["max_kv_loads_per_step"]
        ),
        speculative=SpecConfig.from_json(options["speculative_config"]),
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
    from rackserve.spec_decode.proposer import check_spec_checkpoint

    check_checkpoint(options["model"])
    check_spec_checkpoint(engine_config.speculative, options["model"])
    if engine_config.cache.kv_cache_memory is not None:
        from rackserve.device import resolve
        from rackserve.engine.kv_budget import plan_kv_cache

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
