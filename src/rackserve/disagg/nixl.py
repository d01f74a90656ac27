"""NIXL, behind the same interface, used when ``import nixl`` works.

The NIXL wheels (``nixl`` + ``nixl-cu13``, checked on the 2-GPU machine) start UCX agents
that register GPU memory. Here ``kv_connector: nixl`` keeps the control path of wire.py and
moves the bytes over the pair-group path (NCCL on GPUs) until a NIXL read of registered
cache blocks replaces it; the engine refuses the setting at start-up when the package is
missing, naming the install.
"""

from __future__ import annotations

import importlib.util

from rackserve.config import ConfigError


def nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


def check_nixl() -> None:
    """ConfigError naming the fix unless the ``nixl`` package can be imported."""
    if not nixl_available():
        raise ConfigError(
            "kv_connector 'nixl' needs the nixl package (pip install nixl nixl-cu13 on a GPU "
            "host); use kv_connector 'nccl' (GPUs) or 'tcp' / 'shm' (CPU) without it"
        )
    import nixl  # noqa: F401  (a broken install fails here, at start-up)
