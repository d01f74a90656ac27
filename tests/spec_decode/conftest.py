"""Checkpoints shared by the speculative-decoding tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config

from spec_utils import perturbed_copy

VOCAB = 512


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """The tiny target, with its MTP layer (fp32)."""
    return create_checkpoint(
        tiny_config(vocab_size=VOCAB), tmp_path_factory.mktemp("target"), seed=3
    )


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory) -> Path:
    """An unrelated draft of other sizes (3 layers, 4 experts): it agrees with the target
    about as often as chance."""
    cfg = tiny_config(num_layers=3, num_experts=4, vocab_size=VOCAB)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("random_draft"), seed=9, with_mtp=False)


@pytest.fixture(scope="session")
def close_draft_dir(target_dir, tmp_path_factory) -> Path:
    """The target with noise on its head: accepts some drafts, rejects others."""
    return perturbed_copy(target_dir, tmp_path_factory.mktemp("close_draft"), scale=0.6)
