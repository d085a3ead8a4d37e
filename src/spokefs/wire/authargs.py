"""The command-line options every server takes for tokens (spokefs.wire.auth)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth", type=Path, metavar="FILE",
                        help="require a token on every request: FILE holds one per line, "
                        "'NAME SCOPE TOKEN', SCOPE admin, read or read:DS1,DS2 (re-read when "
                        "it changes and on SIGHUP). Without it the server binds to loopback "
                        "only")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a --host other than loopback without --auth (anyone who "
                        "can reach the port can read and change everything)")
