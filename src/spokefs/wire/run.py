"""Running a service: bind, print the ready line, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web


def tune_for_serving() -> None:
    """Interpreter settings for a long-running data service.

    - The cyclic collector runs after every 700 new container objects by default; a service
      that makes a few short-lived objects per block read then spends a few percent of its
      CPU walking its long-lived ones (manifests, indexes). Acyclic garbage is freed by
      reference counting anyway, so collect young objects less often and move what exists
      at start out of the collector's way.
    - A helper thread (the store's writer, the checker) waits up to the 5 ms switch interval
      for the GIL whenever the event loop is busy; 1 ms keeps their work flowing.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    sys.setswitchinterval(0.001)


async def serve_forever(app: web.Application, host: str, port: int, role: str,
                        on_ready: Callable[[str], Awaitable[None]] | None = None, *,
                        sock: socket.socket | None = None, unix_path: str | None = None
                        ) -> None:
    """Serve ``app`` on host:port (or on ``sock``, already bound and listening: a worker of
    several sharing one port), and also on ``unix_path`` if given, until SIGINT/SIGTERM."""
    tune_for_serving()
    # Large backlog and no access log: the hot path is small range requests.
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site: web.BaseSite
    if sock is not None:
        site = web.SockSite(runner, sock)
    else:
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    if unix_path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unix_path)  # left by a process that was killed
        await web.UnixSite(runner, unix_path).start()
    bound = site._server.sockets[0]  # type: ignore[union-attr]
    bound_host, bound_port = bound.getsockname()[:2]
    url = f"http://{bound_host}:{bound_port}"
    # The ready line: tests, benchmarks and scripts parse it (port 0 picks a free port).
    print(f"spokefs {role} listening on {url}", flush=True)
    if on_ready is not None:
        await on_ready(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        print(f"spokefs {role} stopping", file=sys.stderr, flush=True)
        await runner.cleanup()
