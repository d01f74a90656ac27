"""Configuring the host KV pool: CacheConfig checks, serve flags, the optional Mooncake
transport (a fake store stands in for the package)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rackserve.cli import build_parser
from rackserve.config import CacheConfig, ConfigError
from rackserve.kv.offload.mooncake import MooncakeKVPool, parse_mooncake_url
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.server.options import build_engine_config, resolve_options


def test_cache_config_checks_the_pool_options():
    assert not CacheConfig().uses_kv_pool
    assert CacheConfig(kv_offload_memory=1 << 20).uses_kv_pool
    with pytest.raises(ConfigError, match="positive number of bytes"):
        CacheConfig(kv_offload_memory=0)
    with pytest.raises(ConfigError, match="not both"):
        CacheConfig(kv_offload_memory=1 << 20, kv_offload_server="tcp://127.0.0.1:5600")
    with pytest.raises(ConfigError, match="ZMQ address"):
        CacheConfig(kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ConfigError, match="enable prefix caching"):
        CacheConfig(kv_offload_memory=1 << 20, enable_prefix_caching=False)
    CacheConfig(kv_offload_server="mooncake://master:50051?metadata=http://m:8080/metadata")


def test_serve_flags_reach_the_cache_config(tmp_path):
    model = create_checkpoint(tiny_config(), tmp_path / "tiny", with_mtp=False)
    argv = ["serve", str(model), "--kv-offload-memory", "256M"]
    argv += ["--kv-events-endpoint", "tcp://127.0.0.1:5557"]
    cache = build_engine_config(resolve_options(build_parser().parse_args(argv))).cache
    assert cache.kv_offload_memory == 256 << 20
    assert cache.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert cache.kv_offload_server is None


def test_mooncake_url():
    setup = parse_mooncake_url("mooncake://m:50051?metadata=http://m:8080/metadata&segment=1024")
    assert setup["master_server_address"] == "m:50051"
    assert setup["metadata_server"] == "http://m:8080/metadata"
    assert (setup["global_segment_size"], setup["protocol"]) == (1024, "tcp")
    with pytest.raises(ValueError, match="metadata"):
        parse_mooncake_url("mooncake://m:50051")
    with pytest.raises(ValueError, match="byte counts"):
        parse_mooncake_url("mooncake://m:1?metadata=x&segment=lots")


def test_mooncake_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(ValueError, match="mooncake-transfer-engine"):
        MooncakeKVPool("mooncake://m:50051?metadata=http://m:8080/metadata")


class FakeStore:  # MooncakeDistributedStore's calls the adapter uses, over a dict
    def setup(self, *args) -> int:
        self.args, self.data = args, {}
        return 0

    def put(self, key: str, value: bytes) -> int:
        self.data[key] = value
        return 0

    def get(self, key: str) -> bytes:
        return self.data.get(key, b"")

    def is_exist(self, key: str) -> int:
        return int(key in self.data)

    def close(self) -> None:
        pass


def test_mooncake_adapter_round_trip(monkeypatch):
    package, store = types.ModuleType("mooncake"), types.ModuleType("mooncake.store")
    store.MooncakeDistributedStore = FakeStore
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.store", store)
    pool = MooncakeKVPool("mooncake://m:50051?metadata=http://m:8080/metadata&segment=100")
    assert pool.put([(b"\x01k", torch.arange(4, dtype=torch.uint8))]) == []
    assert pool.contains([b"\x01k", b"other"]) == [True, False]
    value, missing = pool.get([b"\x01k", b"other"])
    assert value.tolist() == [0, 1, 2, 3] and missing is None
    assert pool.usage().used_bytes == 4 and pool.capacity_bytes == 100
    pool.close()
