"""``rackserve serve``'s options: their defaults (``SERVE_DEFAULTS``), the parsers of
sizes, counts and dtypes, the YAML file under the command line's flags
(``resolve_options``), the combinations ``vllm serve`` refuses, and what the options build
and check before any process starts (``build_engine_config``, ``preflight``).
"""

from __future__ import annotations

import argparse
import re
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
    "async_scheduling": None,
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
    from rackserve.spec_decode.checkpoint import check_spec_checkpoint

    check_checkpoint(options["model"])
    check_spec_checkpoint(engine_config.speculative, options["model"])
    if engine_config.cache.kv_cache_memory is not None:
        from rackserve.device import resolve
        from rackserve.engine.kv_budget import plan_kv_cache

        _, dtype = resolve(engine_config.device, engine_config.dtype)
        plan_kv_cache(engine_config, dtype, engine_config.cache.kv_cache_memory)
    check_tokenizer_dir(options["tokenizer"] or options["model"])
