"""Kernel tests run everywhere: without a CUDA device, Triton interprets them on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports ``rackserve.ops.triton`` (``test_mhc.py`` reloads the module if some other
import got there first).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
