"""The ``spokefs`` command: one entry point, a subcommand per part of the system.

Each part owns its subcommands in its own ``cli`` module, which exposes
``register(subparsers)``; this file only lists them, so parts never edit each other's CLI.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

from spokefs.errors import ConfigError, SpokeError
from spokefs.logs import ENV_LOG_FORMAT, FORMATS, setup_logging

# Module paths whose register(subparsers) adds subcommands, in --help order. The
# spokefs_bench ones (benchmarks, demo) are a package beside this one: listed when present.
COMMAND_MODULES = [
    "spokefs.hub.cli",
    "spokefs.spoke.cli",
    "spokefs.mount.cli",
    "spokefs.wan.cli",
    "spokefs.client.cli",
    "spokefs_bench.cli",
    "spokefs_bench.demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spokefs",
        description="Read a remote dataset at local speed: a hub publishes snapshots, a spoke "
        "caches them near the compute, a mount shows them as ordinary files.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("--token-file", metavar="FILE",
                        help="the token to present to hubs and spokes (its first line); "
                        "else the environment variable SPOKEFS_TOKEN")
    parser.add_argument("--ca-bundle", metavar="FILE",
                        help="certificate authorities to trust for https hubs and spokes "
                        "(PEM); else SPOKEFS_CA_BUNDLE, else the system's")
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help="plain lines (default) or JSON lines (one object per line: time, "
                        f"level, logger, message, fields); else {ENV_LOG_FORMAT}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register_modules(sub, COMMAND_MODULES)
    return parser


def register_modules(sub: argparse._SubParsersAction, names: list[str]) -> None:
    """Let each module add its subcommands (``module.register(sub)``), in order."""
    for name in names:
        if name.startswith("spokefs_bench.") and importlib.util.find_spec("spokefs_bench") is None:
            continue
        importlib.import_module(name).register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO
    try:
        setup_logging(level, args.log_format)  # exported: the processes it starts log alike
        if args.token_file:  # every client in this process (and a mount it starts) uses it
            from spokefs.wire.auth import ENV_TOKEN_FILE, read_token_file

            read_token_file(Path(args.token_file))  # readable, not empty: else a clear error
            os.environ[ENV_TOKEN_FILE] = str(Path(args.token_file).absolute())
        if args.ca_bundle:  # likewise: every https client here and in what it starts
            from spokefs.wire.tls import ENV_CA_BUNDLE

            if not Path(args.ca_bundle).is_file():
                raise ConfigError(f"--ca-bundle {args.ca_bundle}: no such file")
            os.environ[ENV_CA_BUNDLE] = str(Path(args.ca_bundle).absolute())
        return int(args.func(args) or 0)
    except SpokeError as exc:
        print(f"spokefs: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
