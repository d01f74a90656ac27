"""Fixtures of tests/reliability (the helpers live in reliability_harness.py)."""

from reliability_harness import tiny_model

__all__ = ["tiny_model"]
