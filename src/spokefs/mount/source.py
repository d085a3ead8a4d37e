"""Where a mount's bytes come from: an upstream over HTTP, or a cache embedded in the process.

Both resolve the snapshot once (``latest`` pins to an id at start), load its manifest, and
serve ``read(version, start, end)``. A read retries transient failures with backoff until the
mount's deadline and then raises ``ReadFailed`` naming the cause, so the FUSE layer answers
EIO instead of leaving a process stuck in the kernel; the next read tries again, so reads work
again as soon as the upstream is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from spokefs.cache.shared import SharedCache, SharedLoc
from spokefs.cache.store import CHUNK
from spokefs.client.urls import parse_url
from spokefs.errors import (
    ConfigError,
    RangeNotSatisfiable,
    ReadFailed,
    SpokeError,
    Transient,
    UpstreamUnavailable,
)
from spokefs.manifest import Manifest
from spokefs.retry import NEAR, retrying
from spokefs.wire.backend import FileSegment
from spokefs.wire.client import UpstreamClient
from spokefs.wire.headers import H_INTERNAL, H_SNAPSHOT
from spokefs.wire.http1 import DataClient

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed mount URL: ``http://host:port/<dataset>[@<snapshot>]``, or the whole
    namespace, ``http://host:port/`` (``dataset`` ""; ``mount/namespace.py``)."""

    base: str
    dataset: str
    snapshot: str = "latest"

    @property
    def namespace(self) -> bool:
        return not self.dataset

    @classmethod
    def parse(cls, url: str) -> Target:
        """By the rules every spokefs URL follows (``parse_url``); a mount's names no path.
        A URL that names no dataset is the namespace: every dataset, each a folder."""
        url = url.strip()
        full = url if "://" in url else f"http://{url}"
        if not urlsplit(full).path.strip("/"):
            try:  # the scheme and host checks of every spokefs URL
                u = parse_url(full.rstrip("/") + "/x")
            except ConfigError:
                raise ConfigError(f"not a spokefs URL: {url!r} (expected http://HOST:PORT/ "
                                  "or http://HOST:PORT/DATASET[@SNAPSHOT])") from None
            return cls(u.base, "")
        u = parse_url(url)
        if u.path:
            raise ConfigError(f"a mount URL names a dataset, not a path in it: {url!r} "
                              "(expected http://HOST:PORT/DATASET[@SNAPSHOT])")
        return cls(u.base, u.dataset, u.snapshot)

    def __str__(self) -> str:
        if self.namespace:
            return f"{self.base}/"
        return f"{self.base}/{self.dataset}@{self.snapshot}"


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
    return await retrying(
        attempt, NEAR.within(deadline), bound_attempts=True, now=now, sleep=sleep,
        give_up=lambda cause: ReadFailed(f"{what}: upstream unavailable for {deadline:g}s "
                                         f"({cause})"))


class UpstreamSource:
    """Reads through a spoke or hub: metadata with ``UpstreamClient``, bytes with ranged GETs
    into the mount's buffers (``DataClient``), both on kept-alive connections. On the
    spoke's own host, resident blocks are read from the spoke's cache files instead
    (``ShortCircuit``), and only what is missing goes over HTTP."""

    def __init__(self, target: Target, deadline: float = 30.0, max_connections: int = 32,
                 short_circuit: bool = True, spoke_cache: Path | None = None) -> None:
        self.target = target
        self.deadline = deadline
        # The per-request timeout is the deadline too: a hung upstream cannot outlast it.
        self.client = UpstreamClient(target.base, max_connections=4,
                                     request_timeout=max(deadline, 1.0))
        self.ranges = DataClient(target.base, max_connections=max_connections,
                                 idle_timeout=max(deadline, 1.0))
        self.want_short_circuit = short_circuit
        self.spoke_cache = spoke_cache
        self._snapshot: dict[str, str] = {}
        self.local: ShortCircuit | None = None

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
        m = await retry_until(self.deadline, f"manifest of {t.dataset}@{snap}",
                              lambda: self.client.manifest(t.dataset, snap))
        # Named on every read: a spoke keeps the files of a snapshot in use (retire_stale).
        self._snapshot = {H_SNAPSHOT: m.snapshot}
        if self.want_short_circuit:
            self.local = await ShortCircuit.probe(self.client, t.dataset, m.snapshot,
                                                  m.block_size, self.deadline,
                                                  self.spoke_cache)
        return m

    async def read_into(self, version: str, start: int, buf: memoryview) -> int:
        if self.local is not None:
            n = await self.local.read_into(version, start, buf)
            if n is not None:
                return n
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
        # The version's ETag is required: an answer for another version never fills buf.
        return (await self.ranges.read_into(path, start, buf, self._snapshot,
                                            etag=version))[0]

    async def close(self) -> None:
        if self.local is not None:
            await self.local.close()
        await self.ranges.close()
        await self.client.close()


class ShortCircuit:
    """Reading the spoke's cache files directly, when the mount runs on the spoke's host
    (``spokefs.cache.shared``): the spoke says where blocks are (``locate``, which fetches
    missing ones first), the mount reads them and checks every byte against the digests the
    spoke gave, in its own buffer. A read whose block moved or left (its check fails) asks
    again; one that fails twice is reported as damaged, and the read goes over HTTP. Reads
    served here are reported to the spoke in batches, so its planner goes on learning."""

    REPORT_EVERY = 0.05
    IN_THREAD = 1 << 20  # a read this large is done off the event loop
    CHUNKS_KEPT = 64     # checked chunks kept for reads of pieces of them (16 MiB)
    LOCS_KEPT = 1 << 18  # block locations kept (~300 bytes each); the oldest go first

    def __init__(self, client: UpstreamClient, dataset: str, snapshot: str, block_size: int,
                 cache: SharedCache, deadline: float, key: bytes) -> None:
        self.client = client
        self._key = {H_INTERNAL: key.decode("ascii", "replace")}  # locate and reads need it
        self.dataset = dataset
        # Named in every locate and report: the spoke keeps this snapshot's files cached
        # while the mount reads them, even after the source changed (retire_stale).
        self.snapshots = [snapshot]
        self.block_size = block_size
        self.cache = cache
        self.deadline = deadline
        self.reader = f"mount-{os.getpid()}"
        self._locs: dict[tuple[str, int], SharedLoc] = {}
        self._chunks: OrderedDict[tuple[str, int, int], memoryview] = OrderedDict()
        self._reads: list[list[object]] = []
        self._reporter: asyncio.Task[None] | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.hits = self.located = self.fallbacks = 0
        self._located_bytes = 0  # read here after a locate: bytes to tell the spoke of
        # Where the spoke's feed of new residents (spokefs.cache.feed) was read up to: every
        # locate and report asks for what came since, so a file the spoke prefetched is
        # read without asking it first.
        self._cursor = 0
        self._asking_news = False
        self._heard: dict[tuple[str, int], dict[str, object]] = {}
        self._more_news = False
        self.learned = 0

    @classmethod
    async def probe(cls, client: UpstreamClient, dataset: str, snapshot: str,
                    block_size: int, deadline: float, spoke_cache: Path | None = None
                    ) -> ShortCircuit | None:
        """A short circuit if the upstream is a spoke whose cache folder this process can
        read (the same host and folder: the id it keeps there matches, the folder is the
        spoke user's alone and holds its key); else None. The folder is ``spoke_cache``,
        else the one the spoke's status names (to an admin token, or without --auth)."""
        try:
            status = await client.get_json("/v1/status")
        except (Transient, SpokeError) as exc:
            log.info("short circuit off: the spoke's status is unavailable (%s)", exc)
            return None
        info = status.get("cache") if status.get("role") == "spoke" else None
        if not isinstance(info, dict) or not info.get("id"):
            return None  # a hub: nothing cached to read
        where = spoke_cache or (Path(str(info["dir"])) if info.get("dir") else None)
        if where is None:
            log.info("short circuit off: the spoke's status names no cache folder to this "
                     "token; give --spoke-cache DIR to read its files from this host")
            return None
        cache = SharedCache(where, str(info["id"]), int(info.get("chunk_size") or CHUNK))
        key = cache.trusted_key() if cache.usable() else None
        if key is None:
            log.info("short circuit off: cannot read the spoke's cache at %s from here "
                     "(another host or container, or no permission); reading over HTTP",
                     where)
            return None
        log.info("short circuit on: reading resident blocks from the spoke's cache at %s",
                 where)
        return cls(client, dataset, snapshot, block_size, cache, deadline, key)

    async def read_into(self, version: str, start: int, buf: memoryview) -> int | None:
        """Fill ``buf`` from bytes ``start`` on of a version; the count, or None to read it
        over HTTP instead (a block the spoke could not keep, a damaged one, the spoke down)."""
        bs = self.block_size
        end = start + len(buf)
        keys = [(version, i) for i in range(start // bs, (end - 1) // bs + 1)]
        missing = [k for k in keys if k not in self._locs and not self._adopt(k)]
        if missing:  # the spoke hears of this read (and counts it) with the locate
            if not await self._locate(missing, fetch=True, read=(version, start, end)):
                return None
        else:
            self._report(version, start, end)
        n = 0
        for key in keys:
            i = key[1]
            lo = max(start, i * bs) - i * bs
            loc = self._locs.get(key)
            if loc is None:
                return None
            hi = min(end - i * bs, loc.size)
            if hi <= lo:
                break
            if not await self._read_block(key, lo, buf[n:n + hi - lo]):
                self.fallbacks += 1
                return None
            n += hi - lo
            if hi < min(bs, end - i * bs):  # the last block of the file: done
                break
        self.hits += 1
        if missing:
            self._located_bytes += n
            self._report()
        return n

    async def _read_block(self, key: tuple[str, int], lo: int, out: memoryview) -> bool:
        for attempt in range(2):
            loc = self._locs.get(key)
            if loc is None and not await self._locate([key], fetch=True):
                return False
            loc = self._locs.get(key)
            if loc is None:
                return False
            chunk = self.cache.chunk_size
            whole = lo % chunk == 0 and ((lo + len(out)) % chunk == 0
                                         or lo + len(out) == loc.size)
            if whole and len(out) >= self.IN_THREAD:
                ok = await asyncio.to_thread(self.cache.read_into, loc, lo, out)
            elif whole:
                ok = self.cache.read_into(loc, lo, out)
            else:  # pieces of chunks (the kernel filling holes): each chunk checked once
                ok = self._pieces(key, loc, lo, out)
            if ok:
                return True
            self._locs.pop(key, None)  # stale (evicted, moved) or damaged: ask again
            if attempt:
                await self._post("locate", {"blocks": [list(key)], "damaged": True})
        return False

    def _pieces(self, key: tuple[str, int], loc: SharedLoc, lo: int, out: memoryview
                ) -> bool:
        """Fill ``out`` (not whole chunks) from checked chunks kept in memory: a chunk is
        read and checked once however many small pieces of it the kernel asks for (a read
        of 4 KiB would otherwise read and hash 256 KiB). Chunks are immutable (keyed by
        the block's version), so one kept is good for as long as it is kept."""
        chunk = self.cache.chunk_size
        n, pos = len(out), 0
        while pos < n:
            at = lo + pos
            c = at // chunk
            data = self._chunk(key, loc, c)
            if data is None:
                return False
            take = min(n - pos, (c + 1) * chunk - at, len(data) - (at - c * chunk))
            out[pos:pos + take] = data[at - c * chunk:at - c * chunk + take]
            pos += take
        return True

    def _chunk(self, key: tuple[str, int], loc: SharedLoc, c: int) -> memoryview | None:
        ck = (key[0], key[1], c)
        kept = self._chunks.get(ck)
        if kept is not None:
            self._chunks.move_to_end(ck)
            return kept
        chunk = self.cache.chunk_size
        size = min(chunk, loc.size - c * chunk)
        if len(self._chunks) >= self.CHUNKS_KEPT:  # reuse the oldest one's buffer
            _, old = self._chunks.popitem(last=False)
            buf = old.obj if isinstance(old.obj, bytearray) else bytearray(chunk)
        else:
            buf = bytearray(chunk)
        view = memoryview(buf)[:size]
        if not self.cache.read_into(loc, c * chunk, view):
            return None
        self._chunks[ck] = view
        return view

    async def _locate(self, keys: list[tuple[str, int]], fetch: bool,
                      read: tuple[str, int, int] | None = None) -> bool:
        doc: dict[str, object] = {"blocks": [list(k) for k in keys], "fetch": fetch}
        if read is not None:
            doc["read"] = {"start": read[1], "end": read[2], "reader": self.reader}
        answer = await self._post_with_news("locate", doc)
        if answer is None or answer.get("cache", {}).get("id") != self.cache.id:
            return False  # the spoke is down, or restarted on another folder
        self.located += len(keys)
        for key, entry in zip(keys, answer["blocks"], strict=True):
            loc = self.cache.loc(entry) if entry is not None else None
            if loc is None:
                self._locs.pop(key, None)
            else:
                self._remember(key, loc)
        return True

    def _adopt(self, key: tuple[str, int]) -> bool:
        """Whether the spoke's feed told us where ``key`` is (now a known location)."""
        entry = self._heard.pop(key, None)
        loc = self.cache.loc(entry) if entry is not None else None
        if loc is None:
            return False
        self._remember(key, loc)
        return True

    def _remember(self, key: tuple[str, int], loc: SharedLoc) -> None:
        self._locs.pop(key, None)  # re-inserted: the newest
        self._locs[key] = loc
        while len(self._locs) > self.LOCS_KEPT:
            del self._locs[next(iter(self._locs))]

    async def _post_with_news(self, what: str, doc: dict[str, object]) -> dict | None:
        """``_post``, asking for the feed too unless a request in flight already does
        (answers to one cursor would bring the same blocks twice)."""
        if self._asking_news:
            return await self._post(what, doc)
        self._asking_news = True
        try:
            answer = await self._post(what, {**doc, "since": self._cursor})
        finally:
            self._asking_news = False
        if answer is not None:
            self._take_news(answer.get("news"))
        return answer

    def _take_news(self, news: object) -> None:
        """Blocks the spoke made resident since we last asked: known before they are read."""
        if not isinstance(news, dict):
            return
        heard = self._heard
        for version, index, entry in news.get("blocks", ()):
            heard[(version, index)] = entry  # decoded when read (most may never be)
        self.learned += len(news.get("blocks", ()))
        while len(heard) > self.LOCS_KEPT:
            del heard[next(iter(heard))]
        self._cursor = int(news.get("cursor", self._cursor))
        self._more_news = bool(news.get("more"))
        if self._more_news:
            self._report()  # ask again soon, with the next report

    async def _post(self, what: str, doc: dict[str, object]) -> dict | None:
        """The spoke's answer; None if it refused or failed at once (then the read goes over
        HTTP); ReadFailed if it gave no answer within the mount's deadline (the read would
        only wait again over HTTP: the caller answers EIO now)."""
        try:
            async with asyncio.timeout(self.deadline):
                return await self.client.post_json(f"/v1/datasets/{self.dataset}/{what}",
                                                   {**doc, "snapshots": self.snapshots},
                                                   self._key)
        except TimeoutError as exc:
            raise ReadFailed(f"the spoke gave no answer within {self.deadline:g}s ({what})"
                             ) from exc
        except (Transient, SpokeError) as exc:
            log.debug("short circuit: %s failed (%s); reading over HTTP", what, exc)
            return None

    def _report(self, version: str | None = None, start: int = 0, end: int = 0) -> None:
        if version is not None:
            self._reads.append([version, start, end, {"reader": self.reader}])
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._send_reports())
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(10.0, self._sweep)

    async def _send_reports(self) -> None:
        """Report reads every REPORT_EVERY while there are any (or news left to fetch)."""
        while True:
            await asyncio.sleep(self.REPORT_EVERY)  # gather what comes meanwhile
            reads, self._reads = self._reads, []
            extra, self._located_bytes = self._located_bytes, 0
            if not (reads or extra or self._more_news):
                return
            self._more_news = False
            with contextlib.suppress(ReadFailed):  # a report lost costs a hint, no more
                await self._post_with_news("reads", {"reads": reads, "by": "mount",
                                                     "bytes": extra})

    def _sweep(self) -> None:
        self._sweeper = None
        self.cache.sweep()

    async def close(self) -> None:
        log.info("short circuit: %d reads from the spoke's cache files, %d blocks located by "
                 "asking, %d locations heard ahead, %d reads over HTTP instead", self.hits,
                 self.located, self.learned, self.fallbacks)
        if self._reporter is not None and not self._reporter.done():
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reporter
        if self._reads or self._located_bytes:  # the last reads count too (briefly tried)
            with contextlib.suppress(Transient, SpokeError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await self.client.post_json(
                        f"/v1/datasets/{self.dataset}/reads",
                        {"reads": self._reads, "by": "mount", "bytes": self._located_bytes,
                         "snapshots": self.snapshots}, self._key)
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.cache.close()


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
        self.snapshot = ""  # the id open() pinned

    async def open(self) -> Manifest:
        t = self.target
        await self.backend.start()
        self._started = True
        try:
            self.snapshot = await self.backend.resolve(t.dataset, t.snapshot)
            return await self.backend.manifest(t.dataset, self.snapshot)
        except UpstreamUnavailable as exc:
            raise ReadFailed(f"cannot load {t}: {exc}") from exc

    async def read_into(self, version: str, start: int, buf: memoryview) -> int:
        end = start + len(buf)
        what = f"{self.target.dataset} {version} [{start},{end})"
        self.backend.snapshots_used(self.target.dataset, [self.snapshot])  # while mounted
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
    """Fill ``buf`` from ``fd`` at ``offset`` (a block's region of a segment file: no
    thread)."""
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [buf[n:]], offset + n)
        if got == 0:
            raise ReadFailed(f"cache block ended {len(buf) - n} bytes early")
        n += got
    return n
