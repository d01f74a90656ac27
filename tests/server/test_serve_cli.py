"""`rackserve serve` option resolution: defaults < YAML config < command-line flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from rackserve.cli import build_parser
from rackserve.server.options import build_engine_config, parse_bytes, resolve_options


def options(*argv: str) -> dict:
    return resolve_options(build_parser().parse_args(["serve", *argv]))


def test_defaults_bind_loopback() -> None:
    resolved = options("models/x")
    assert resolved["host"] == "127.0.0.1" and resolved["port"] == 8000
    assert resolved["enable_prefix_caching"] is True


def test_yaml_then_cli_precedence(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: models/a\nport: 9000\nmax-model-len: 1024\nkv_cache_memory: 64M\n"
        "enable-prefix-caching: false\nserved-model-name: alias\n"
    )
    resolved = options("--config", str(config), "--port", "9100")
    assert resolved["model"] == "models/a" and resolved["port"] == 9100
    assert resolved["max_model_len"] == 1024 and resolved["kv_cache_memory"] == 64 << 20
    assert resolved["enable_prefix_caching"] is False
    assert resolved["served_model_name"] == ["alias"]
    assert options("--config", str(config), "--enable-prefix-caching")["enable_prefix_caching"]


def test_bad_configs(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("model: m\nmax-modle-len: 5\n")
    with pytest.raises(ValueError, match="unknown option 'max-modle-len'"):
        options("--config", str(config))
    with pytest.raises(ValueError, match="no model given"):
        options()


def test_parse_bytes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1.5GiB") == 3 << 29


def test_engine_config_from_flags(tiny_model: Path) -> None:
    config = build_engine_config(
        options(str(tiny_model), "--max-model-len", "256", "--max-num-seqs", "4")
    )
    assert config.scheduler.max_model_len == 256 and config.scheduler.max_num_seqs == 4
    assert config.model_name == str(tiny_model)


def test_too_small_kv_budget_fails_in_one_line(tmp_path: Path, capsys) -> None:
    from rackserve.cli import main
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    model = create_checkpoint(tiny_config(num_layers=3, vocab_size=512), tmp_path / "m")
    argv = ["serve", str(model), "--port", "0", "--kv-cache-memory", "1M"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "raise --kv-cache-memory" in err and "Traceback" not in err
