"""The ``spokefs`` command: one entry point, a subcommand per part of the system.

Each part owns its subcommands in its own ``cli`` module, which exposes
``register(subparsers)``; this file only lists them, so parts never edit each other's CLI.
Once all are registered, ``spokefs.config`` walks the parser: every option of every command
can also come from the environment or a TOML file (flag > environment > file > default).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from spokefs import config
from spokefs.errors import ConfigError, SpokeError
from spokefs.logs import ENV_LOG_FORMAT, FORMATS, LEVELS, level_for, setup_logging

# Module paths whose register(subparsers) adds subcommands, in --help order (a new part adds
# its line here). The spokefs_bench ones (benchmarks, demo) are a package beside this one:
# listed when present.
COMMAND_MODULES = [
    "spokefs.hub.cli",
    "spokefs.spoke.cli",
    "spokefs.mount.cli",
    "spokefs.csi.cli",
    "spokefs.wan.cli",
    "spokefs.client.cli",
    "spokefs.client.ckpt",
    "spokefs_bench.cli",
    "spokefs_bench.demo",
]


class _Version(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
                         **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("spokefs")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        print(f"spokefs {v}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; its ``parse_args`` also reads the environment and --config."""
    parser = config.Parser(
        prog="spokefs",
        description="Read a remote dataset at local speed: a hub publishes snapshots, a spoke "
        "caches them near the compute, a mount shows them as ordinary files.",
        epilog="Every option can also be set in the environment or a TOML file: "
        "SPOKEFS_COMMAND_OPTION (SPOKEFS_SPOKE_SERVE_CACHE_SIZE, or SPOKEFS_SPOKE_CACHE_SIZE "
        "for every spoke action; SPOKEFS_LOG_FORMAT for an option before the command), and "
        "--config FILE with a table per command ([spoke.serve] cache_size = \"200GiB\"). A "
        "flag beats the environment, which beats the file; `spokefs COMMAND --print-config` "
        "shows each setting and where it came from.",
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output: debug messages")
    parser.add_argument("-q", "--quiet", action="count", default=0,
                        help="less log output: -q warnings and errors only, -qq errors only")
    parser.add_argument("--log-level", choices=LEVELS, type=str.lower, default=None,
                        help="the log level outright (beats -v and -q given the same way: "
                        "a flag beats the environment, which beats a file; default info)")
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
    config.prepare(parser)  # last: it walks every command registered above
    return parser


def register_modules(sub: argparse._SubParsersAction, names: list[str]) -> None:
    """Let each module add its subcommands (``module.register(sub)``), in order."""
    for name in names:
        if name.startswith("spokefs_bench.") and importlib.util.find_spec("spokefs_bench") is None:
            continue
        importlib.import_module(name).register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
        args._argv = argv  # what a command that re-runs itself passes on (a background mount)
        if getattr(args, "print_config", False):
            return config.print_config(args)
        o = args._config.origins
        level = level_for(args.verbose, args.quiet, args.log_level,
                          max(o["verbose"].rank, o["quiet"].rank), o["log_level"].rank)
        setup_logging(level, args.log_format)  # exported: the processes it starts log alike
        # From the environment these two are read where they are used (as before: a token in
        # SPOKEFS_TOKEN beats the file); from a flag or a file they are checked now and put
        # there for every client in this process and what it starts (a mount).
        if args.token_file and o["token_file"].kind != "env":
            from spokefs.wire.auth import ENV_TOKEN_FILE, read_token_file

            read_token_file(Path(args.token_file))  # readable, not empty: else a clear error
            os.environ[ENV_TOKEN_FILE] = str(Path(args.token_file).absolute())
        if args.ca_bundle and o["ca_bundle"].kind != "env":
            from spokefs.wire.tls import ENV_CA_BUNDLE

            if not Path(args.ca_bundle).is_file():
                where = "" if o["ca_bundle"].kind == "flag" else f" ({o['ca_bundle']})"
                raise ConfigError(f"--ca-bundle {args.ca_bundle}{where}: no such file")
            os.environ[ENV_CA_BUNDLE] = str(Path(args.ca_bundle).absolute())
        return int(args.func(args) or 0)
    except SpokeError as exc:
        print(f"spokefs: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
