"""The I/O edge of the WAN emulator: an asyncio TCP proxy that releases bytes on the link's time.

Each accepted connection gets two pipes (client -> upstream "up", upstream -> client "down").
A pipe reads up to ``CHUNK`` bytes at a time, asks its ``Flow`` when to release them, queues
them and keeps reading; one timer per pipe releases the queue head when due. Reading pauses
while the flow says so (window full, wire booked ahead), while the destination's send buffer
is full, or while the link is cut. All timing decisions live in ``spokefs.wan.link``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from spokefs.wan.link import Flow, Link, LinkConfig, parse_address

log = logging.getLogger("spokefs.wan")

CHUNK = 256 * 1024  # largest read: big reads keep the per-byte Python cost negligible
WRITE_HIGH = 1024 * 1024  # a destination's send buffer above this pauses its source
WRITE_LOW = 256 * 1024
_EOF, _RESET = "eof", "reset"  # pipe signals queued behind data, never reordered with it


@dataclass
class WanStats:
    """Counters since start or the last ``reset_counters()``."""

    bytes_up: int = 0  # bytes delivered client -> upstream
    bytes_down: int = 0  # bytes delivered upstream -> client
    connections: int = 0  # connections accepted and proxied
    refused: int = 0  # connections closed on arrival because the link was cut
    resets: int = 0  # stalled connections reset after a cut


def _reset_transport(transport: asyncio.BaseTransport) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped link looks to the peer."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Side(asyncio.BufferedProtocol):
    """One TCP endpoint of a proxied connection: feeds ``out``, is written by ``into``."""

    def __init__(self, conn: _Connection, out: _Pipe, into: _Pipe) -> None:
        self.conn = conn
        self.out = out
        self.into = into
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)
        self.conn.side_made(self)

    def get_buffer(self, sizehint: int) -> bytearray:
        # A fresh buffer per read: queued chunks (and, since 3.12, transports) keep references.
        self._buf = bytearray(min(CHUNK, max(self.out.flow.room(), 1)))
        return self._buf

    def buffer_updated(self, nbytes: int) -> None:
        buf = self._buf
        if nbytes == len(buf):
            data: bytes | bytearray | memoryview = buf
        elif nbytes < len(buf) // 2:
            data = bytes(buf[:nbytes])  # do not hold a large buffer for a small read
        else:
            data = memoryview(buf)[:nbytes]
        self.out.push(data)

    def eof_received(self) -> bool:
        self.out.push_signal(_EOF)
        return True  # stay open for writing: the other direction may still be flowing

    def pause_writing(self) -> None:
        self.into.set_dst_full(True)

    def resume_writing(self) -> None:
        self.into.set_dst_full(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.conn.side_lost(self, exc)


class _Pipe:
    """One direction of one connection: a delay line from ``src`` to ``dst``."""

    __slots__ = ("conn", "deliver_timer", "dst", "dst_full", "flow", "name", "pending",
                 "read_paused", "signal_done", "src", "src_done", "wake_timer")

    def __init__(self, conn: _Connection, name: str, flow: Flow) -> None:
        self.conn = conn
        self.name = name
        self.flow = flow
        self.src: _Side | None = None
        self.dst: _Side | None = None
        self.pending: deque[tuple[float, Any]] = deque()  # (release time, data or signal)
        self.deliver_timer: asyncio.TimerHandle | None = None
        self.wake_timer: asyncio.TimerHandle | None = None
        self.read_paused = False
        self.dst_full = False
        self.src_done = False  # src sent EOF or went away: read nothing more
        self.signal_done: str | None = None  # the EOF or reset already passed on to dst

    # -- input ---------------------------------------------------------------------------
    def push(self, data: bytes | bytearray | memoryview) -> None:
        self.pending.append((self.flow.send(len(data)), data))
        if self.deliver_timer is None:
            self.schedule()
        self.update_reading()

    def push_signal(self, signal: str) -> None:
        if self.src_done:
            return
        self.src_done = True
        self.pending.append((self.flow.send_eof(), signal))
        self.schedule()
        self.update_reading()

    # -- release -------------------------------------------------------------------------
    def schedule(self) -> None:
        if (self.deliver_timer is None and self.pending and self.dst is not None
                and not self.conn.wan.is_cut and not self.conn.finished):
            self.deliver_timer = self.conn.loop.call_at(self.pending[0][0], self.deliver)

    def deliver(self) -> None:
        self.deliver_timer = None
        dst = self.dst
        if dst is None or self.conn.wan.is_cut:
            return
        transport = dst.transport
        assert transport is not None
        pending, now, moved = self.pending, self.conn.loop.time(), 0
        while pending and pending[0][0] <= now:
            data = pending.popleft()[1]
            if data.__class__ is str:
                self.conn.wan.count(self.name, moved)
                self.pass_signal(data)
                return
            if not transport.is_closing():
                transport.write(data)
                moved += len(data)
        self.conn.wan.count(self.name, moved)
        self.schedule()
        self.update_reading()

    def pass_signal(self, signal: str) -> None:
        dst, src = self.dst, self.src
        assert dst is not None and dst.transport is not None
        self.signal_done = signal
        self.pending.clear()
        if signal == _RESET:
            _reset_transport(dst.transport)
        elif src is not None and src.lost:
            dst.transport.close()  # the sender is gone entirely: finish writing, then close
        elif dst.transport.can_write_eof():
            dst.transport.write_eof()  # half-close, as the sender did
        self.conn.maybe_close()

    # -- flow control --------------------------------------------------------------------
    def set_dst_full(self, full: bool) -> None:
        self.dst_full = full
        self.update_reading()

    def update_reading(self) -> None:
        src = self.src
        if src is None or src.transport is None or src.lost:
            return
        if self.src_done or self.conn.wan.is_cut or self.dst_full:
            wake, stop = None, True
        else:
            wake = self.flow.wake_at()
            stop = wake is not None
        if stop:
            if not self.read_paused:
                self.read_paused = True
                src.transport.pause_reading()
            if wake is not None and self.wake_timer is None:
                self.wake_timer = self.conn.loop.call_at(wake, self._wake)
        elif self.read_paused:
            self.read_paused = False
            src.transport.resume_reading()

    def _wake(self) -> None:
        self.wake_timer = None
        self.update_reading()

    def stop_timers(self) -> None:
        for timer in (self.deliver_timer, self.wake_timer):
            if timer is not None:
                timer.cancel()
        self.deliver_timer = self.wake_timer = None


class _Connection:
    """A client connection, its upstream connection and the two pipes between them."""

    def __init__(self, wan: WanLink, loop: asyncio.AbstractEventLoop) -> None:
        self.wan = wan
        self.loop = loop
        up_flow, down_flow = wan.link.open()
        self.up = _Pipe(self, "up", up_flow)
        self.down = _Pipe(self, "down", down_flow)
        self.client = _Side(self, out=self.up, into=self.down)
        self.upstream = _Side(self, out=self.down, into=self.up)
        self.finished = False

    def side_made(self, side: _Side) -> None:
        side.out.src = side
        side.into.dst = side
        if side is self.client:
            return
        if self.finished or self.client.lost:  # the client left while we dialled
            _reset_transport(side.transport)  # type: ignore[arg-type]
            return
        self.up.schedule()  # client bytes may already be queued
        self.up.update_reading()
        self.down.update_reading()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if self.finished:
            return
        side.into.stop_timers()
        side.into.pending.clear()  # nowhere to deliver them now
        side.into.update_reading()
        # Pass the loss on behind the bytes already in flight, as the network would.
        side.out.push_signal(_EOF if exc is None else _RESET)
        other = self.upstream if side is self.client else self.client
        if other.lost or other.transport is None:
            self.finish()

    def maybe_close(self) -> None:
        if self.up.signal_done and self.down.signal_done:
            self.close()

    def close(self) -> None:
        for side in (self.client, self.upstream):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()
        if self.upstream.transport is None:
            self.finish()

    def reset(self) -> None:
        for side in (self.client, self.upstream):
            if side.transport is not None and not side.lost:
                _reset_transport(side.transport)
        if self.upstream.transport is None:
            self.finish()

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        for pipe in (self.up, self.down):
            pipe.stop_timers()
            pipe.pending.clear()
        self.wan._connections.discard(self)

    def stall(self) -> None:
        for pipe in (self.up, self.down):
            if pipe.deliver_timer is not None:
                pipe.deliver_timer.cancel()
                pipe.deliver_timer = None
            pipe.update_reading()

    def unstall(self) -> None:
        for pipe in (self.up, self.down):
            pipe.schedule()
            pipe.update_reading()


class WanLink:
    """A long link between clients and one upstream TCP server, run inside an event loop.

    ``upstream``, ``listen`` and ``control`` are ``"host:port"`` or ``(host, port)``; port 0
    picks a free port (read ``port`` / ``control_port`` after ``start()``); ``control=None``
    runs no control server. ``rtt`` and ``jitter`` take seconds or "60ms"; ``bandwidth`` bytes/s
    or "400MB/s" (None: no cap); ``window`` bytes or "1MiB" (None: no limit).
    """

    def __init__(self, upstream: str | tuple[str, int], *,
                 listen: str | tuple[str, int] = "127.0.0.1:0",
                 control: str | tuple[str, int] | None = "127.0.0.1:0",
                 rtt: float | str = 0.0, bandwidth: float | str | None = None,
                 jitter: float | str = 0.0, window: int | str | None = None) -> None:
        self.upstream = parse_address(upstream)
        self.listen = parse_address(listen)
        self.control = parse_address(control) if control is not None else None
        config = LinkConfig().updated(rtt=rtt, bandwidth=bandwidth, jitter=jitter, window=window)
        self.link = Link(config, clock=time.monotonic)  # re-clocked to the loop in start()
        self.stats = WanStats()
        self.host = self.listen[0]
        self.port = 0
        self.control_port = 0
        self.is_cut = False
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._control_runner: Any = None
        self._reset_timer: asyncio.TimerHandle | None = None

    @property
    def config(self) -> LinkConfig:
        return self.link.config

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.link.clock = loop.time
        self._server = await loop.create_server(self._accept, *self.listen)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.control is not None:
            from spokefs.wan.control import start_control

            self._control_runner, self.control_port = await start_control(self, *self.control)
        log.info("wan link on %s:%d -> %s:%d, %s", self.host, self.port, *self.upstream,
                 self.config.to_json())

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._reset_timer is not None:
            self._reset_timer.cancel()
        for conn in list(self._connections):
            conn.reset()
            conn.finish()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._control_runner is not None:
            await self._control_runner.cleanup()
            self._control_runner = None

    async def __aenter__(self) -> WanLink:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- control -------------------------------------------------------------------------
    def cut(self, reset_after: float = 5.0) -> None:
        """Partition the link: refuse new connections, stall open ones, reset those still
        open after ``reset_after`` seconds. Cutting again re-arms the reset timer."""
        assert self._loop is not None, "start() the link first"
        self.is_cut = True
        for conn in self._connections:
            conn.stall()
        if self._reset_timer is not None:
            self._reset_timer.cancel()
        self._reset_timer = self._loop.call_later(max(reset_after, 0.0), self._reset_stalled)
        log.info("wan link cut; resetting stalled connections in %.3gs", reset_after)

    def restore(self) -> None:
        """Heal the link: stalled connections carry on with the bytes they had queued."""
        self.is_cut = False
        if self._reset_timer is not None:
            self._reset_timer.cancel()
            self._reset_timer = None
        for conn in list(self._connections):
            conn.unstall()
        log.info("wan link restored")

    def set(self, **changes: object) -> LinkConfig:
        """Change rtt / bandwidth / jitter / window live (see ``LinkConfig.updated``).
        Bytes already queued keep their release times; bytes are never reordered."""
        self.link.config = self.link.config.updated(**changes)
        for conn in list(self._connections):  # a larger window may let a flow read again
            conn.up.update_reading()
            conn.down.update_reading()
        log.info("wan link set %s", self.link.config.to_json())
        return self.link.config

    def reset_counters(self) -> None:
        self.stats = WanStats()

    def status(self) -> dict[str, Any]:
        return {**self.config.to_json(), "cut": self.is_cut, **asdict(self.stats),
                "active_connections": self.active_connections,
                "process_cpu_s": time.process_time()}

    # -- internals -----------------------------------------------------------------------
    def count(self, direction: str, nbytes: int) -> None:
        if direction == "up":
            self.stats.bytes_up += nbytes
        else:
            self.stats.bytes_down += nbytes

    def _accept(self) -> asyncio.BaseProtocol:
        assert self._loop is not None
        if self.is_cut:
            self.stats.refused += 1
            return _Refuse()
        self.stats.connections += 1
        conn = _Connection(self, self._loop)
        self._connections.add(conn)
        task = self._loop.create_task(self._dial(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn.client

    async def _dial(self, conn: _Connection) -> None:
        assert self._loop is not None
        try:
            await self._loop.create_connection(lambda: conn.upstream, *self.upstream)
        except OSError as exc:
            log.warning("wan link: upstream %s:%d unreachable (%s); resetting the client",
                        *self.upstream, exc)
            conn.reset()

    def _reset_stalled(self) -> None:
        self._reset_timer = None
        for conn in list(self._connections):
            self.stats.resets += 1
            conn.reset()


class _Refuse(asyncio.Protocol):
    """What a connection arriving during a cut gets: an immediate reset."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _reset_transport(transport)


class WanLinkThread:
    """A ``WanLink`` on its own event loop in a daemon thread, for synchronous callers.

    ``with WanLinkThread("127.0.0.1:8080", rtt="60ms") as wan: ... wan.port ... wan.cut()``.
    The control methods run on the link's loop and return when done.
    """

    def __init__(self, upstream: str | tuple[str, int], **kwargs: Any) -> None:
        self.link = WanLink(upstream, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.link.port

    @property
    def control_port(self) -> int:
        return self.link.control_port

    def start(self, timeout: float = 10.0) -> WanLinkThread:
        started: dict[str, BaseException | None] = {}
        ready = threading.Event()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopped = asyncio.Event()
            try:
                await self.link.start()
            except Exception as exc:  # handed to the starting thread, which raises it
                started["error"] = exc
                ready.set()
                return
            started["error"] = None
            ready.set()
            try:
                await self._stopped.wait()
            finally:
                await self.link.stop()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True,
                                        name=f"wan-{self.link.upstream[1]}")
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("the WAN link did not start in time")
        if started["error"] is not None:
            self._thread.join()
            raise started["error"]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None or self._stopped is None:
            return
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout)
        self._thread = None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``link.<method>(*args, **kwargs)`` on the link's loop and return its result."""
        assert self._loop is not None, "start() first"

        async def run() -> Any:
            return getattr(self.link, method)(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10.0)

    def cut(self, reset_after: float = 5.0) -> None:
        self.call("cut", reset_after)

    def restore(self) -> None:
        self.call("restore")

    def set(self, **changes: object) -> LinkConfig:
        return self.call("set", **changes)

    def reset_counters(self) -> None:
        self.call("reset_counters")

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def __enter__(self) -> WanLinkThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
