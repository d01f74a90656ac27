"""`rackserve` command line: one sub-command family per package.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "rackserve.model.cli",  # model create, generate
    "rackserve.bench.cli",
    "rackserve.planner.cli",
    "rackserve.server.cli",
    "rackserve.kv.offload.server",  # kv-pool: the host KV pool shared by a host's engines
    "rackserve.router.cli",
    "rackserve.disagg.demo",  # demo (--pd: P/D with the router)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rackserve", description="Serve DeepSeek-V4-class MoE models, from one CPU to a rack."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, OSError) as e:
        # Bad input (config, paths, checkpoints) ends with one clear line, not a traceback.
        print(f"rackserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
