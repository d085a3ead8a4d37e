"""``spokefs wan``: run the WAN link emulator in front of one TCP server."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

from spokefs.errors import ConfigError, SpokeError
from spokefs.units import parse_duration, parse_rate, parse_size
from spokefs.wan.link import format_address, parse_address
from spokefs.wan.proxy import WanLink

DESCRIPTION = """\
Emulate a long network link in user space: a TCP proxy that delays every byte by rtt/2 each
way (the pipe stays full), caps each direction at one bandwidth shared by all connections,
charges a new connection one round trip, and can be cut and restored through a control port.
On start it prints one line, "spokefs wan listening on HOST:PORT control http://HOST:PORT".
"""


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Let argparse report our ConfigError as a usage error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", type=_arg(parse_address), default="127.0.0.1:0",
                   metavar="HOST:PORT",
                   help="where clients connect; port 0 picks a free port (default: %(default)s)")
    p.add_argument("--upstream", type=_arg(parse_address), required=True, metavar="HOST:PORT",
                   help="the server at the far end of the link")
    p.add_argument("--rtt", type=_arg(parse_duration), default=0.0, metavar="DURATION",
                   help="round-trip time, e.g. 60ms; each direction gets half (default: 0)")
    p.add_argument("--bandwidth", type=_arg(parse_rate), default=None, metavar="RATE",
                   help="cap per direction, shared by all connections, e.g. 400MB/s or "
                   "1Gbit/s (default: no cap)")
    p.add_argument("--jitter", type=_arg(parse_duration), default=0.0, metavar="DURATION",
                   help="extra one-way delay per chunk, uniform in [0, DURATION]; bytes are "
                   "never reordered (default: 0)")
    p.add_argument("--window", type=_arg(parse_size), default=None, metavar="SIZE",
                   help="bytes in flight per connection and direction, like a TCP window: one "
                   "stream tops out near SIZE/rtt (default: no limit)")
    p.add_argument("--control", type=_arg(parse_address), default="127.0.0.1:0",
                   metavar="HOST:PORT",
                   help="control HTTP port: GET /status, POST /cut, /restore, /set, "
                   "/reset-counters (default: %(default)s)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("wan", help="emulate a long network link in front of a server",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def make_link(args: argparse.Namespace) -> WanLink:
    return WanLink(args.upstream, listen=args.listen, control=args.control, rtt=args.rtt,
                   bandwidth=args.bandwidth or None, jitter=args.jitter,
                   window=args.window or None)


async def serve(args: argparse.Namespace) -> int:
    link = make_link(args)
    await link.start()
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        control = format_address(link.control[0] if link.control else link.host,
                                 link.control_port)
        print(f"spokefs wan listening on {format_address(link.host, link.port)} "
              f"control http://{control}", flush=True)
        await stop.wait()
    finally:
        await link.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> int:
    """``python -m spokefs.wan``: the same command without the rest of the spokefs CLI."""
    from spokefs.logs import env_level, setup_logging

    p = argparse.ArgumentParser(prog="python -m spokefs.wan", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        setup_logging(env_level())  # as SPOKEFS_LOG_FORMAT and SPOKEFS_LOG_LEVEL say
        return run(args)
    except SpokeError as exc:
        print(f"spokefs wan: error: {exc}", file=sys.stderr)
        return 2
