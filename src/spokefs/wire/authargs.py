"""The command-line options every server takes for tokens, TLS and the audit log
(spokefs.wire.auth, spokefs.wire.tls, spokefs.audit)."""

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
    parser.add_argument("--tls-cert", type=Path, metavar="FILE",
                        help="serve https with this certificate (PEM; with --tls-key)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE",
                        help="the certificate's private key (PEM)")
    parser.add_argument("--audit-log", metavar="FILE",
                        help="write an audit log to FILE: one JSON line per read (token "
                        "name, dataset, path or version, bytes), refusal, and cache summary; "
                        "rotated at 64 MiB, 5 kept. A spoke's replica worker N writes "
                        "FILE.worker-N")


def tls_paths(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(cert, key), or None for plain http; a clear error if only one is given."""
    from spokefs.errors import ConfigError

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    return None if args.tls_cert is None else (args.tls_cert, args.tls_key)
