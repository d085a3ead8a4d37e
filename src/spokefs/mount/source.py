"""Where a mount's bytes come from: an upstream over HTTP, or a cache embedded in the process.

Both resolve the snapshot once (``latest`` pins to an id at start), load its manifest, and
serve ``read(version, start, end)``. A read retries transient failures with backoff until the
mount's deadline and then raises ``ReadFailed`` naming the cause, so the FUSE layer answers
EIO instead of leaving a process stuck in the kernel; the next read tries again, so reads work
again as soon as the upstream is back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from spokefs.errors import ConfigError, RangeNotSatisfiable, SpokeError, UpstreamUnavailable
from spokefs.manifest import Manifest
from spokefs.mount.http import RangeClient
from spokefs.retry import backoff_delays
from spokefs.wire.backend import FileSegment
from spokefs.wire.client import Transient, UpstreamClient

log = logging.getLogger(__name__)

T = TypeVar("T")

_URL = re.compile(r"^(https?://[^/]+(?:/.*)?)/([^/@]+)(?:@([^/@]+))?/?$")


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed mount URL: ``http://host:port/<dataset>[@<snapshot>]``."""

    base: str
    dataset: str
    snapshot: str = "latest"

    @classmethod
    def parse(cls, url: str) -> Target:
        m = _URL.match(url.strip())
        if not m:
            raise ConfigError(f"not a dataset URL: {url!r} (expected "
                              "http://HOST:PORT/DATASET or http://HOST:PORT/DATASET@SNAPSHOT)")
        return cls(m.group(1), m.group(2), m.group(3) or "latest")

    def __str__(self) -> str:
        return f"{self.base}/{self.dataset}@{self.snapshot}"


class ReadFailed(Exception):
    """A read that could not be answered; the message says why (logged with the EIO)."""


class Source(Protocol):
    target: Target
    deadline: float

    async def open(self) -> Manifest: ...            # resolve the snapshot, load its manifest
    async def read_into(self, version: str, start: int, buf: memoryview) -> int: ...
    async def close(self) -> None: ...


async def retry_until(deadline: float, what: str, attempt: Callable[[], Awaitable[T]],
                      now: Callable[[], float] | None = None,
                      sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> T:
    """Run ``attempt`` until it succeeds, retrying ``Transient`` with backoff; each attempt
    and the whole run are bounded by ``deadline`` seconds, then ``ReadFailed``."""
    clock = now or asyncio.get_running_loop().time
    give_up = clock() + deadline
    cause = "no attempt made"
    for delay in backoff_delays(first=0.02, cap=0.5):
        left = give_up - clock()
        if left <= 0:
            break
        try:
            async with asyncio.timeout(left):
                return await attempt()
        except Transient as exc:
            cause = str(exc)
        except TimeoutError:
            cause = f"no answer within {deadline:g}s"
            break
        if clock() + delay >= give_up:
            break
        await sleep(delay)
    raise ReadFailed(f"{what}: upstream unavailable for {deadline:g}s ({cause})")


class UpstreamSource:
    """Reads through a spoke or hub: metadata with ``UpstreamClient``, bytes with ranged GETs
    into the mount's buffers (``RangeClient``), both on kept-alive connections."""

    def __init__(self, target: Target, deadline: float = 30.0, max_connections: int = 32
                 ) -> None:
        self.target = target
        self.deadline = deadline
        # The per-request timeout is the deadline too: a hung upstream cannot outlast it.
        self.client = UpstreamClient(target.base, max_connections=4,
                                     request_timeout=max(deadline, 1.0))
        # The lean reader speaks plain http only; https goes through aiohttp (one copy more).
        self.ranges = (RangeClient(target.base, max_connections=max_connections)
                       if target.base.startswith("http://") else None)

    async def open(self) -> Manifest:
        t = self.target
        snap = t.snapshot
        if snap == "latest":
            info = await retry_until(self.deadline, f"dataset {t.dataset!r}",
                                     lambda: self.client.get_json(f"/v1/datasets/{t.dataset}"))
            snap = info.get("latest")
            if not snap:
                raise ConfigError(f"dataset {t.dataset!r} at {t.base} has no snapshot yet; "
                                  "run `spokefs hub snapshot` first")
        return await retry_until(self.deadline, f"manifest of {t.dataset}@{snap}",
                                 lambda: self.client.manifest(t.dataset, snap))

    async def read_into(self, version: str, start: int, buf: memoryview) -> int:
        path = f"/v1/datasets/{self.target.dataset}/objects/{version}"
        what = f"{self.target.dataset} {version} [{start},{start + len(buf)})"
        try:
            return await retry_until(self.deadline, what, lambda: self._read_into(
                path, version, start, buf))
        except RangeNotSatisfiable:
            return 0
        except SpokeError as exc:  # the upstream's final answer: 404, 410, 400
            raise ReadFailed(f"{what}: {exc}") from exc

    async def _read_into(self, path: str, version: str, start: int, buf: memoryview) -> int:
        if self.ranges is not None:
            return await self.ranges.read_into(path, start, buf)
        block = await self.client.read_range(self.target.dataset, version, start,
                                             start + len(buf))
        buf[:len(block.data)] = block.data
        return len(block.data)

    async def close(self) -> None:
        if self.ranges is not None:
            await self.ranges.close()
        await self.client.close()


class EmbeddedSource:
    """A spoke cache inside the mount process (single-node use, no spoke service)."""

    def __init__(self, target: Target, cache_dir: Path, cache_size: int,
                 deadline: float = 30.0, policy: str = "lru") -> None:
        from spokefs.spoke.service import SpokeBackend, SpokeConfig

        self.target = target
        self.deadline = deadline
        self.backend = SpokeBackend(SpokeConfig(upstream=target.base, cache_dir=cache_dir,
                                                cache_size=cache_size, policy=policy,
                                                deadline=deadline))
        self._started = False

    async def open(self) -> Manifest:
        t = self.target
        await self.backend.start()
        self._started = True
        try:
            snap = await self.backend.resolve(t.dataset, t.snapshot)
            return await self.backend.manifest(t.dataset, snap)
        except UpstreamUnavailable as exc:
            raise ReadFailed(f"cannot load {t}: {exc}") from exc

    async def read_into(self, version: str, start: int, buf: memoryview) -> int:
        end = start + len(buf)
        what = f"{self.target.dataset} {version} [{start},{end})"
        n = 0
        try:
            # The backend retries until its deadline (ours); the timeout is a backstop.
            async with asyncio.timeout(self.deadline + 5.0):
                async for seg in self.backend.read(self.target.dataset, version, start, end):
                    if isinstance(seg, FileSegment):
                        try:
                            n += _pread_into(seg.file.fileno(), buf[n:n + seg.count],
                                             seg.offset)
                        finally:
                            seg.release()
                    else:
                        buf[n:n + len(seg)] = seg
                        n += len(seg)
        except RangeNotSatisfiable:
            return 0
        except TimeoutError as exc:
            raise ReadFailed(f"{what}: no answer within {self.deadline:g}s") from exc
        except SpokeError as exc:
            raise ReadFailed(f"{what}: {exc}") from exc
        return n

    async def close(self) -> None:
        if self._started:
            await self.backend.close()


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``fd`` at ``offset`` (a block file in the page cache: no thread)."""
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [buf[n:]], offset + n)
        if got == 0:
            raise ReadFailed(f"cache block ended {len(buf) - n} bytes early")
        n += got
    return n
