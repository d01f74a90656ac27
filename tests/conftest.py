"""Suite-wide settings."""

import os

import pytest
import torch

# Without a CUDA device, Triton kernels run under its interpreter on CPU tensors. The
# variable is read when a kernel is defined (on import), so it is set before any test
# module can import a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import skip_nested_patches

    skip_nested_patches()

# The tiny test models are far too small to gain from intra-op threads, and with other
# processes on the 2 cores (servers under test) spinning thread pools cost 10x.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip without a CUDA device (``pytest -m gpu`` on a CPU machine
    reports them skipped, not failed)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
