"""ParallelConfig / EPLBConfig: vLLM's flag names, validation that names the fix, and the
serve flags that build them."""

import argparse

import pytest

from rackserve.config import ConfigError, EPLBConfig, ParallelConfig
from rackserve.server.cli import register
from rackserve.server.options import resolve_options


def test_eplb_config_from_json():
    config = EPLBConfig.from_json('{"window_size": 10, "step_interval": 30}')
    assert (config.window_size, config.step_interval) == (10, 30)
    assert EPLBConfig.from_json(None) == EPLBConfig()
    assert EPLBConfig().window_size == 1000 and EPLBConfig().step_interval == 3000
    with pytest.raises(ConfigError, match="unknown keys"):
        EPLBConfig.from_json('{"window": 10}')
    with pytest.raises(ConfigError, match="window_size"):
        EPLBConfig(window_size=0)


def test_parallel_config_validation_names_the_fix():
    dep4 = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
    assert dep4.expert_parallel_size == 4 and dep4.num_physical_experts(8) == 8
    with pytest.raises(ConfigError, match="--num-redundant-experts"):
        ParallelConfig(
            data_parallel_size=4, enable_expert_parallel=True, num_redundant_experts=1
        ).num_physical_experts(8)
    with pytest.raises(ConfigError, match="--enable-expert-parallel"):
        ParallelConfig(data_parallel_size=2, enable_eplb=True)
    with pytest.raises(ConfigError, match="--data-parallel-rpc-port"):
        ParallelConfig(data_parallel_size=4, data_parallel_size_local=2)
    with pytest.raises(ConfigError, match="--data-parallel-start-rank"):
        ParallelConfig(
            data_parallel_size=4, data_parallel_size_local=2, data_parallel_rpc_port=9000,
            headless=True,
        )  # fmt: skip
    # the redundant count may come from --eplb-config, as vLLM spells it
    from_eplb = ParallelConfig(
        data_parallel_size=2,
        enable_expert_parallel=True,
        eplb=EPLBConfig(num_redundant_experts=2),
    )
    assert from_eplb.num_redundant == 2 and from_eplb.num_physical_experts(8) == 10
    assert ParallelConfig(data_parallel_size=2).expert_parallel_size == 1  # DP only


def test_serve_flags():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "m", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
         "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1",
         "--data-parallel-rpc-port", "13345", "--headless", "--enable-expert-parallel",
         "--num-redundant-experts", "4", "--enable-eplb",
         "--eplb-config", '{"window_size": 50, "step_interval": 200}']
    )  # fmt: skip
    options = resolve_options(args)
    assert options["data_parallel_size"] == 4 and options["headless"] is True
    assert options["data_parallel_start_rank"] == 2
    assert options["eplb_config"] == '{"window_size": 50, "step_interval": 200}'
    assert options["num_redundant_experts"] == 4 and options["enable_eplb"] is True
