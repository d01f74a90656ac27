"""Fixtures the indexer's kernel tests share (``test_indexer.py``, ``test_indexer_topk.py``)."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def indexer():
    # the root conftest chose the interpreter (no GPU) before anything imported Triton
    return importlib.import_module("rackserve.ops.triton.indexer")


@pytest.fixture(scope="module")
def select_topk():
    return importlib.import_module("rackserve.ops.triton.select_topk")


@pytest.fixture(scope="module")
def indexer_tiling():
    return importlib.import_module("rackserve.ops.triton.indexer_tiling")


@pytest.fixture
def poisoned_indexer_outputs(indexer, select_topk, monkeypatch):
    """Unwritten logits read NaN; unwritten packed keys read the largest int64 (picked first)."""

    def empty(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(indexer, "_empty", empty)
    monkeypatch.setattr(select_topk, "_empty", empty)
