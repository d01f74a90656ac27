"""--speculative-config: parsing, validation and the errors that name the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rackserve.config import ConfigError, SpecConfig
from rackserve.spec_decode.checkpoint import check_spec_checkpoint

from spec_utils import random_draft_dir, spec_engine, target_dir


def test_from_json():
    assert SpecConfig.from_json(None) is None and SpecConfig.from_json("") is None
    spec = SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3}')
    assert spec == SpecConfig("mtp", 3)
    assert SpecConfig.from_json({"method": "draft_model", "model": "d"}) == SpecConfig(
        "draft_model", 1, "d"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"num_speculative_tokens": 2}', 'needs "method"'),
        ('{"method": "eagle"}', "method 'eagle' is not supported"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', r"in \[1, 8\]"),
        ('{"method": "mtp", "num_speculative_tokens": 9}', r"in \[1, 8\]"),
        ('{"method": "mtp", "num_speculative_tokens": 2.5}', r"in \[1, 8\]"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "mtp", "model": "x"}', 'drop "model"'),
        ('{"method": "mtp", "k": 2}', "unknown keys"),
    ],
)
def test_bad_values_name_the_fix(text, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig.from_json(text)


def test_checkpoint_checks(target_dir, random_draft_dir, tmp_path):
    check_spec_checkpoint(SpecConfig("mtp", 2), target_dir)
    check_spec_checkpoint(SpecConfig("draft_model", 2, str(random_draft_dir)), target_dir)
    with pytest.raises(ConfigError, match=r"no mtp\.\* weights"):
        check_spec_checkpoint(SpecConfig("mtp", 2), random_draft_dir)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        check_spec_checkpoint(SpecConfig("draft_model", 2, str(tmp_path)), target_dir)
    with pytest.raises(ConfigError, match=r"no mtp\.\* weights"):  # the engine checks too
        spec_engine(random_draft_dir, SpecConfig("mtp", 1))


def test_draft_vocabulary_must_match(target_dir, tmp_path):
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    other = create_checkpoint(tiny_config(num_layers=2, vocab_size=300), tmp_path / "v300")
    with pytest.raises(ConfigError, match=r"vocabulary \(300\) differs from the target's \(512\)"):
        check_spec_checkpoint(SpecConfig("draft_model", 1, str(other)), target_dir)


def test_serve_refuses_in_one_line(random_draft_dir):
    """Preflight: the error before any process starts, exit status 2."""
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", str(random_draft_dir),
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no mtp.* weights" in done.stderr and "Traceback" not in done.stderr
