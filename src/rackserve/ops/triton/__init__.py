"""Triton kernels for the model ops, each tested against its ``ops.reference`` spec.

Importing this package imports triton; ``ops/__init__.py`` decides when to dispatch here.
Set TRITON_INTERPRET=1 before the import to run the kernels on CPU tensors (tests).
"""

from rackserve.ops.triton.mhc import hc_head, hc_post, hc_post_pre, hc_pre

__all__ = ["hc_head", "hc_post", "hc_post_pre", "hc_pre"]
