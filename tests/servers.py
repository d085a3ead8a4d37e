"""Real hub, spoke and link processes for tests: started with the CLI, port 0, ready line."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import urllib3

from spokefs.procs import Service

# Ports a test names before its process starts (tier members name each other) come from a
# block per xdist worker below the kernel's ephemeral range (32768-60999): a port found by
# bind(0) and then closed could be taken by another worker's bind(0) or by an outgoing
# connection before the process binds it (EADDRINUSE, seen in CI).
_PORT_BLOCK = 1500
_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
_PORT_BASE = 20000 + (int(_worker) if _worker.isdigit() else 0) % 8 * _PORT_BLOCK
_start = random.randrange(_PORT_BLOCK)  # two runs side by side rarely start at the same port
_ports = ((_start + i) % _PORT_BLOCK for i in itertools.count())


def free_port() -> int:
    """A port on 127.0.0.1 that is bindable now and that no other test worker hands out."""
    for offset in itertools.islice(_ports, _PORT_BLOCK):
        port = _PORT_BASE + offset
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PORT_BASE}..{_PORT_BASE + _PORT_BLOCK}")


class ServerProcess(Service):
    """A spokefs service process for tests (see spokefs.procs.Service)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(list(args), env=env)


def make_dataset(root: Path, n_small: int = 20, small_size: int = 100_000,
                 big_sizes: tuple[int, ...] = (9_000_000, 4 * 1024 * 1024), seed: int = 1
                 ) -> Path:
    """A small synthetic dataset: class folders of small files and a few multi-block files."""
    rng = random.Random(seed)
    for i in range(n_small):
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img{i:04d}.jpg").write_bytes(rng.randbytes(small_size + i))
    shards = root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(big_sizes):
        (shards / f"shard-{i:03d}.tar").write_bytes(rng.randbytes(size))
    (root / "empty.txt").write_bytes(b"")
    (root / "empty_dir").mkdir(exist_ok=True)
    return root


def hub(dataset: Path, state_dir: Path, *extra: str) -> ServerProcess:
    return ServerProcess("hub", "serve", str(dataset), "--port", "0", "--state-dir",
                         str(state_dir), *extra)


def spoke(upstream: str, cache_dir: Path, cache_size: str = "1GiB", *extra: str,
          env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess("spoke", "serve", "--upstream", upstream, "--cache-dir",
                         str(cache_dir), "--cache-size", cache_size, "--port", "0",
                         "--no-fsync", *extra, env=env)


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric ``name`` (those with ``labels``) a server exports."""
    text = urllib3.request("GET", f"{base}/metrics").data.decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def output_with(proc: ServerProcess, text: str, timeout: float = 10.0) -> str:
    """The process's output so far, once ``text`` is in it (a thread reads the output: a
    line the process wrote may arrive a moment later), or as it is after ``timeout``."""
    end = time.monotonic() + timeout
    while text not in (out := "".join(proc.output)) and time.monotonic() < end:
        time.sleep(0.05)
    return out


class CuttingProxy:
    """A TCP proxy in front of a server that cuts one response, a network fault at an exact
    point: the first response after ``cut`` bytes, or (``on``) the answer to the first
    request that begins with ``on``, before its first byte. It records every request it
    forwards."""

    def __init__(self, upstream: tuple[str, int], cut: int = 0, on: bytes | None = None
                 ) -> None:
        self.upstream = upstream
        self.cut = cut
        self.on = on
        self.armed = False   # the request ``on`` names went up
        self.done = False    # one response was cut
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    @contextlib.contextmanager
    def running(self) -> Iterator[int]:
        """Served from a thread of its own (for a test that is not async); its port."""
        loop = asyncio.new_event_loop()
        port = loop.run_until_complete(self.start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield port
        finally:
            # Torn down inside its loop: connections cancelled and closed there, so none is
            # left to close itself on a closed loop when it is collected.
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the transports' connection_lost callbacks run

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.upstream)

        async def up() -> None:
            while data := await cr.read(65536):
                self.requests.append(data)
                if self.on is not None and data.startswith(self.on):
                    self.armed = True
                uw.write(data)

        async def down() -> None:
            sent = 0
            while data := await ur.read(65536):
                keep = -1  # bytes of this piece let through before the cut; -1: no cut
                if not self.done and self.on is None and sent + len(data) >= self.cut:
                    keep = self.cut - sent
                elif not self.done and self.armed:
                    keep = 0
                if keep >= 0:
                    cw.write(data[:keep])
                    await cw.drain()
                    self.done = True
                    cw.transport.abort()
                    return
                sent += len(data)
                cw.write(data)
                await cw.drain()

        try:
            await asyncio.gather(up(), down())
        except (ConnectionError, OSError):
            pass
        finally:
            uw.close()
            cw.close()
