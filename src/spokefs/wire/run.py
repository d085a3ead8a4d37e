"""Running a service: bind, print the ready line, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web


async def serve_forever(app: web.Application, host: str, port: int, role: str,
                        on_ready: Callable[[str], Awaitable[None]] | None = None) -> None:
    # Large backlog and no access log: the hot path is small range requests.
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    bound_host, bound_port = sock.getsockname()[:2]
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
