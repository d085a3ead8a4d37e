"""Running a service: bind, print the ready line, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from spokefs.wire.server import AUTH_KEY, RELOAD_KEY
from spokefs.wire.tls import server_context
from spokefs.wire.unixpath import unix_address

# A connection that has not sent a whole request within this many seconds (a slow sender of
# headers, or an idle keep-alive) is closed. aiohttp's default keeps one for an hour.
IDLE_TIMEOUT = float(os.environ.get("SPOKEFS_IDLE_TIMEOUT", "30"))
# Connections served at once; more are answered 503 and closed, so a flood of clients
# cannot take every file descriptor the cache and the hub's files need.
MAX_CONNECTIONS = int(os.environ.get("SPOKEFS_MAX_CONNECTIONS", "4096"))

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error": {"code": "overloaded", "message": "too many connections; '
              b'try again shortly"}}')


class _Refuse(asyncio.Protocol):
    """Answers 503 at once and hangs up (a connection over the cap)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
        transport.close()


class _CappedServer:
    """aiohttp's protocol factory, refusing connections beyond ``cap``."""

    def __init__(self, inner: web.Server, cap: int) -> None:
        self.inner = inner
        self.cap = cap

    def __call__(self) -> asyncio.Protocol:
        if len(self.inner.connections) >= self.cap:
            return _Refuse()
        return self.inner()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _Runner(web.AppRunner):
    @property
    def server(self) -> web.Server | None:  # what the sites hand to create_server
        inner = super().server
        return None if inner is None else _CappedServer(inner, MAX_CONNECTIONS)  # type: ignore[return-value]


def _no_reload() -> None:
    print("SIGHUP: nothing to read again (no --auth, no --dataset-config)", file=sys.stderr,
          flush=True)


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
    # Descriptors: one per client connection and open file; the soft limit (often 1024)
    # is raised to what the system allows this process.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve_forever(app: web.Application, host: str, port: int, role: str,
                        on_ready: Callable[[str], Awaitable[None]] | None = None, *,
                        sock: socket.socket | None = None, unix_path: str | None = None,
                        tls: tuple[Path, Path] | None = None) -> None:
    """Serve ``app`` on host:port (or on ``sock``, already bound and listening: a worker of
    several sharing one port), and also on ``unix_path`` if given, until SIGINT/SIGTERM."""
    tune_for_serving()
    # Large backlog and no access log: the hot path is small range requests.
    # auto_decompress off: bodies are inflated by the routes, with a bound (a refused gzip
    # bomb would otherwise go on inflating in aiohttp after the 413).
    runner = _Runner(app, access_log=None, handle_signals=False,
                     keepalive_timeout=IDLE_TIMEOUT, auto_decompress=False)
    await runner.setup()
    site: web.BaseSite
    ssl_context = server_context(*tls) if tls is not None else None
    if sock is not None:
        site = web.SockSite(runner, sock, ssl_context=ssl_context)
    else:
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True,
                           ssl_context=ssl_context)
    await site.start()
    if unix_path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unix_path)  # left by a process that was killed
        await web.UnixSite(runner, unix_address(unix_path)).start()
    bound = site._server.sockets[0]  # type: ignore[union-attr]
    bound_host, bound_port = bound.getsockname()[:2]
    url = f"{'https' if tls else 'http'}://{bound_host}:{bound_port}"
    # The ready line: tests, benchmarks and scripts parse it (port 0 picks a free port).
    print(f"spokefs {role} listening on {url}", flush=True)
    if on_ready is not None:
        await on_ready(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tokens = app.get(AUTH_KEY)
    reloads = [*([tokens.reload] if tokens is not None else []), *app.get(RELOAD_KEY, [])]

    def on_hangup() -> None:  # files read again (they are also re-read when they change)
        for fn in reloads:
            fn()
        if not reloads:
            _no_reload()

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        await stop.wait()
    finally:
        print(f"spokefs {role} stopping", file=sys.stderr, flush=True)
        await runner.cleanup()
