"""Write-back: files written through the spoke into a writable dataset of its hub. A write is
answered once its bytes are durable on the spoke's disk and checked against the version
their writer declared; the spoke then uploads them to the hub in the background, and a
commit made here is sent to the hub once every file it names is whole there. A reader at
the hub, or at any spoke, sees the commit's files all at once or not at all.

The protocol is the hub's own (``hub/uploads.py``, docs/protocol.md): the same routes, so a
writer (``spokefs ckpt push``, ``Uploader``) talks to a spoke as to a hub. What differs:

- ``POST .../commit`` answers 202: the commit is durable here, not yet at the hub.
  ``GET .../uploads`` then lists it under ``commits`` (``local`` or ``uploading``, bytes
  left) until the hub has published it, then under ``done`` with the hub's snapshot id;
  ``spokefs ckpt wait`` blocks until then.
- Unsafe bytes (held here, not yet published at the hub) are bounded by ``--unsafe-quota``:
  past it, while the link is down, a new upload is refused with 507 (``ENOSPC`` at a
  writer) and a log line; nothing acknowledged is ever dropped.

Where things are (``CACHE/writeback/DS/``): the uploads and commit journals of ``Incoming``
(its receiving and checking, reused as they are), ``done.jsonl`` (commits the hub has
published, newest last) and ``COMMIT.sent`` markers (a commit was sent: on a restart, the
hub is asked whether it landed before anything is sent again). The hub is the truth for
what it holds: after a restart, each upload resumes from the bytes the hub reports.

``SENDS_AT_ONCE`` uploads go to the hub at once (one TCP stream seldom fills a long link),
oldest commit first. While readers wait on the upstream, each holds its next piece up to a
second (``spoke.uploadpace``): reads keep priority, and a checkpoint still moves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from spokefs.cache.durable import DirectReader, write_durably
from spokefs.errors import (
    BadRequest,
    Conflict,
    DigestMismatch,
    Forbidden,
    NoSpace,
    NotFound,
    SpokeError,
    Transient,
    UpstreamUnavailable,
)
from spokefs.hub.uploads import Incoming, Placed, Upload, _key
from spokefs.spoke.kept import Keeper
from spokefs.spoke.metadata import Metadata
from spokefs.spoke.uploadpace import UploadPacer
from spokefs.wire.client import UpstreamClient
from spokefs.wire.errors import error_for_transport, raise_for_status
from spokefs.wire.headers import H_OFFSET, H_SIZE, H_VERSION

log = logging.getLogger(__name__)

PIECE = 1 << 20          # bytes read from a part per piece of an upload's body
DONE_KEPT = 100          # commits published, listed in a dataset's ``done``
EXPIRE_EVERY = 3600.0    # seconds between drops of uploads no commit took for a week
IDLE = 2.0               # seconds between looks for work when none was signalled
BACKOFF_MOST = 30.0      # seconds between tries while the hub is unreachable
SENDS_AT_ONCE = 4        # uploads to the hub in flight at once
CHECK_TIMEOUT = 5.0      # seconds a commit waits for the hub's latest snapshot to check it
WRITE_TIMEOUT = 900.0    # seconds an upload's answer may take: the hub reads the file back


class WriteBack:
    """Every writable dataset's write-back on this spoke (``root``: CACHE/writeback)."""

    def __init__(self, root: Path, metadata: Metadata, clients: list[UpstreamClient],
                 unsafe_quota: int) -> None:
        self.root = root
        self.metadata = metadata
        self.clients = clients  # per upstream (metadata.routes' order): long timeouts
        self.unsafe_quota = unsafe_quota
        self._incoming: dict[str, Incoming] = {}
        self._wake = asyncio.Event()
        self.sent_bytes = 0          # bytes uploaded to the hub by this process
        self.handoff_files = self.handoff_bytes = 0  # same-host writers' (spoke.handoff)
        self.last_error: str | None = None
        self._refused: dict[tuple[str, str], int] = {}  # 422s from the hub, per upload
        # Uploads discarded here whose copy at the hub goes next (in memory: after a restart,
        # the hub drops what no commit takes after ABANDONED_AFTER).
        self._discards: set[tuple[str, str]] = set()
        # (dataset, path, version) the hub holds whole (it said so): not asked again.
        self._at_hub: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()  # making an Incoming (threads and the loop)
        self._expired_at = 0.0         # when the last expiry ran (time.monotonic)
        # Published commits into this spoke's cache, the last ones pinned (spoke.kept); set
        # by the spoke's backend, None: a commit's local copies go once published.
        self.keeper: Keeper | None = None
        # True while readers wait on the upstream: uploads hold their next piece a while
        # (spoke.uploadpace); set by the spoke's backend.
        self.reads_waiting: Callable[[], bool] = lambda: False
        self.held_s = 0.0  # seconds uploads held a piece behind reads, in all
        # Commits the hub published, recorded in ``done.jsonl``, whose files are still being
        # kept into the cache ((dataset, journal): its paths): safe, so neither listed under
        # ``commits`` nor counted as unsafe bytes.
        self._safe: dict[tuple[str, Path], frozenset[str]] = {}

    # -- what is held ------------------------------------------------------------------------
    async def incoming(self, ds: str) -> Incoming:
        """``ds``'s uploads here; Forbidden unless the hub serves it writable. With the hub
        unreachable, what this spoke wrote down when it first wrote to ``ds`` stands."""
        try:
            info = await self.metadata.dataset(ds)
        except (Transient, UpstreamUnavailable):
            inc = self._incoming.get(ds) or await asyncio.to_thread(self._restored, ds)
            if inc is None:
                raise
            return inc
        if not info.writable:
            raise Forbidden(f"dataset {ds!r} is read-only at its hub: a spoke writes back only "
                            "to a dataset the hub declares writable")
        inc = self._incoming.get(ds) or await asyncio.to_thread(self._open, ds,
                                                                info.block_size)
        if inc.block_size != info.block_size:
            # Digests made here would not be the hub's: what is held stays, and is sent as
            # it is (the hub checks it against the version declared); new writes wait.
            raise Conflict(f"dataset {ds!r} changed its block size at the hub "
                           f"({inc.block_size} -> {info.block_size}) while this spoke holds "
                           "writes to it; they go first, then restart the spoke")
        return inc

    def _open(self, ds: str, block_size: int) -> Incoming:
        """``ds``'s folder here, its block size written down (durably) for a restart."""
        with self._lock:  # one Incoming per dataset: its guards are in memory
            if ds in self._incoming:
                return self._incoming[ds]
            folder = self.root / ds
            (folder / "data").mkdir(parents=True, exist_ok=True)
            write_durably(folder / "dataset.json",
                          json.dumps({"block_size": block_size}).encode())
            return self._made(ds, block_size)

    def _restored(self, ds: str) -> Incoming | None:
        with self._lock:
            if ds in self._incoming:
                return self._incoming[ds]
            try:
                doc = json.loads((self.root / ds / "dataset.json").read_bytes())
                block_size = int(doc["block_size"])
            except (OSError, ValueError, KeyError, TypeError):
                return None
            return self._made(ds, block_size)

    def _made(self, ds: str, block_size: int) -> Incoming:
        inc = Incoming(self.root / ds / "data", self.root / ds, block_size)
        inc.pending()  # the commits answered before a restart: their paths stay guarded
        self._incoming[ds] = inc
        return inc

    def _known(self) -> dict[str, Incoming]:
        """Every dataset with a folder here (a restart's too)."""
        if self.root.is_dir():
            for folder in self.root.iterdir():
                if folder.name not in self._incoming and folder.is_dir():
                    self._restored(folder.name)
        return dict(self._incoming)

    def collect(self) -> Iterator[Metric]:
        """At scrape time (a collector of the spoke's registry), per dataset written here."""
        labels = ["dataset"]
        unsafe = GaugeMetricFamily("spokefs_writeback_unsafe_bytes", "Bytes written through "
                                   "this spoke and not yet published at the hub", labels=labels)
        oldest = GaugeMetricFamily("spokefs_writeback_oldest_unsafe_seconds", "Age of the "
                                   "oldest upload held here and not yet published at the hub "
                                   "(0: none)", labels=labels)
        commits = GaugeMetricFamily("spokefs_writeback_commits_waiting", "Commits made here "
                                    "and not yet published at the hub", labels=labels)
        now = time.time()
        for ds, inc in self._known().items():
            doc = self._listing(ds, inc, self._safe_of(ds))
            ages = []
            for up in doc["uploads"]:
                try:
                    ages.append(now - (inc.dir / f"{_key(up['path'])}.json").stat().st_mtime)
                except FileNotFoundError:
                    continue
            unsafe.add_metric([ds], doc["unsafe_bytes"])
            oldest.add_metric([ds], max(ages, default=0.0))
            commits.add_metric([ds], len(doc["commits"]))
        yield unsafe
        yield oldest
        yield commits
        yield CounterMetricFamily("spokefs_writeback_sent_bytes", "Bytes this spoke uploaded "
                                  "to its hub (write-back)", value=self.sent_bytes)
        yield CounterMetricFamily("spokefs_writeback_handoff_bytes", "Bytes same-host "
                                  "writers handed over by descriptor (spoke.handoff), not sent "
                                  "over HTTP", value=self.handoff_bytes)
        yield CounterMetricFamily("spokefs_writeback_handoff_files", "Files same-host writers "
                                  "handed over by descriptor", value=self.handoff_files)
        yield CounterMetricFamily("spokefs_writeback_held_seconds", "Seconds uploads to the "
                                  "hub held a piece back while readers waited on it",
                                  value=self.held_s)
        if self.keeper is not None:
            yield CounterMetricFamily("spokefs_writeback_cached_bytes", "Bytes of published "
                                      "commits put into this spoke's cache from their local "
                                      "copies (--keep-checkpoints)",
                                      value=self.keeper.kept_bytes)
            yield GaugeMetricFamily("spokefs_writeback_pinned_bytes", "Bytes of the last "
                                    "published commits pinned in this spoke's cache",
                                    value=self.keeper.last.pinned_bytes)

    def unsafe_bytes(self) -> int:
        """Bytes held here that the hub has not published yet."""
        total = 0
        for ds, inc in self._known().items():
            published = self._safe_of(ds)[1]
            total += sum(u["size"] for u in inc.listing() if u["path"] not in published)
        return total

    async def receive(self, ds: str, path: str, size: int, version: str, offset: int,
                      body: AsyncIterator[bytes]) -> dict[str, Any]:
        inc = await self.incoming(ds)
        held_now = await asyncio.to_thread(inc.upload, path)
        if offset == 0 and (held_now is None or held_now.version != version):
            await self._within_quota(ds, path, size, held_now)
        done = await inc.receive(path, size, version, offset, body)
        if done["whole"]:
            self._wake.set()
        return done

    async def admit(self, ds: str, path: str, size: int) -> Incoming:
        """Where a same-host handoff of ``path`` is copied in (``Incoming.adopt``, in the
        handoff's own thread: a long copy holds no thread the loop's reads need), once its
        bytes are within the quota. ``adopted`` after."""
        inc = await self.incoming(ds)
        await self._within_quota(ds, path, size, await asyncio.to_thread(inc.upload, path))
        return inc

    def adopted(self, size: int) -> None:
        """A handoff of ``size`` bytes was held whole (the loop's thread)."""
        self.handoff_files += 1
        self.handoff_bytes += size
        self._wake.set()

    async def _within_quota(self, ds: str, path: str, size: int, held_now: Upload | None
                            ) -> None:
        """NoSpace (and a log line) if ``size`` new bytes of ``path`` would pass
        ``--unsafe-quota``; what is held of ``path`` now is replaced, so not counted."""
        held = await asyncio.to_thread(self.unsafe_bytes)
        held -= held_now.size if held_now is not None else 0
        if held + size > self.unsafe_quota:
            log.error("write-back of %s/%s refused: %d bytes are not yet safe at the hub, "
                      "the quota is %d (--unsafe-quota); is the link down? %s", ds, path,
                      held, self.unsafe_quota, self.last_error or "")
            raise NoSpace(f"the spoke holds {held} bytes not yet safe at the hub; "
                          f"{size} more would pass its quota of {self.unsafe_quota} "
                          "(--unsafe-quota): wait for the uploads to the hub")

    async def discard(self, ds: str, path: str) -> None:
        """Drop an upload here, and next its copy at the hub (sent there already, or being
        sent: the hub's is removed after)."""
        inc = await self.incoming(ds)
        await asyncio.to_thread(inc.discard, path)
        self._discards.add((ds, path))
        self._wake.set()

    async def commit(self, ds: str, paths: list[str] | None, prefix: str | None
                     ) -> dict[str, Any]:
        """The commit journalled here (durably); the hub gets it once its files are whole
        there. 202's document: what it names and how much is left to send."""
        inc = await self.incoming(ds)
        taken = await self._taken_at_hub(ds)
        journal, chosen = await asyncio.to_thread(inc.prepare, paths, prefix, taken)
        self._wake.set()
        return {"dataset": ds, "commit": journal.stem, "committed": chosen, "safe": False,
                "state": "local"}

    async def _taken_at_hub(self, ds: str) -> Callable[[str], str | None] | None:
        """Why a path cannot be committed, by the hub's latest snapshot: a commit the hub
        would refuse is refused now (409), not answered 202 and failed later. None when the
        hub cannot say within ``CHECK_TIMEOUT`` (the hub decides when the commit reaches it)."""
        try:
            m = await asyncio.wait_for(asyncio.shield(self.metadata.latest_manifest(ds)),
                                       CHECK_TIMEOUT)
        except (Transient, UpstreamUnavailable, NotFound, TimeoutError):
            return None
        if m is None:
            return None
        files, folders = set(m.paths), set(m.dirs)

        def taken(path: str) -> str | None:
            if path in files:
                return (f"{path!r} exists in the dataset at the hub already (snapshot "
                        f"{m.snapshot}); a writable dataset only grows (write a new path)")
            if path in folders:
                return f"{path!r} is a folder in the dataset at the hub"
            parts = path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in files:
                    return f"{'/'.join(parts[:i])!r} is a file in the dataset at the hub"
            return None

        return taken

    async def listing(self, ds: str) -> dict[str, Any]:
        inc = await self.incoming(ds)
        return await asyncio.to_thread(self._listing, ds, inc, self._safe_of(ds))

    def _safe_of(self, ds: str) -> tuple[frozenset[Path], frozenset[str]]:
        """The journals of ``ds`` published but not yet retired, and their paths."""
        # A copy first (one C call): scrapes and the quota's check run in threads.
        mine = {j: paths for (d, j), paths in list(self._safe.items()) if d == ds}
        return frozenset(mine), frozenset().union(*mine.values())

    def _listing(self, ds: str, inc: Incoming,
                 safe: tuple[frozenset[Path], frozenset[str]] = (frozenset(), frozenset())
                 ) -> dict[str, Any]:
        journals, published = safe
        ups = [u for u in inc.listing() if u["path"] not in published]
        sizes = {u["path"]: u["size"] for u in ups}
        commits = []
        for journal, paths in self._journals(inc):
            if journal in journals:
                continue
            left = sum(sizes.get(p, 0) for p in paths)
            # "waiting": the last try to reach the hub failed (``last_error`` says why).
            commits.append({"commit": journal.stem, "files": len(paths), "paths": paths,
                            "bytes": left,
                            "state": "waiting" if self.last_error else "uploading"})
        failed = []
        for journal in sorted((inc.journals / "failed").glob("*.json")):
            try:
                doc = json.loads(journal.read_bytes())
            except (OSError, ValueError):
                continue
            failed.append({"commit": journal.stem, "error": doc.get("error"),
                           "paths": [u["path"] for u in doc.get("uploads", [])]})
        return {"dataset": ds, "uploads": ups, "commits": commits, "failed": failed,
                "done": self._done(ds), "unsafe_bytes": sum(sizes.values()),
                "last_error": self.last_error}

    def _journals(self, inc: Incoming) -> list[tuple[Path, list[str]]]:
        return [(journal, [u.path for u in ups]) for journal, ups in inc.pending()]

    def _done(self, ds: str) -> list[dict[str, Any]]:
        return read_done(self.root / ds / "done.jsonl")

    async def _repin(self) -> None:
        """The last commits published before a restart, pinned again (``keeper``)."""
        if self.keeper is None or self.keeper.last.keep <= 0:
            return
        keep = self.keeper.last.keep
        known = await asyncio.to_thread(self._known)
        for ds, inc in known.items():
            for doc in (await asyncio.to_thread(self._done, ds))[-keep:]:
                try:
                    files = [(str(v), int(n)) for v, n in doc.get("versions") or ()]
                except (TypeError, ValueError):
                    continue  # a line this version did not write
                if files:
                    self.keeper.restore(ds, str(doc.get("commit")), files, inc.block_size)

    # -- to the hub --------------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: send what is whole here to the hub, then the commits whose files all are."""
        await self._repin()
        pause = IDLE
        while True:
            try:
                busy = await self.pass_once()
                self.last_error = None
                pause = IDLE if not busy else 0.0
            except (SpokeError, OSError, aiohttp.ClientError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                pause = min(max(pause * 2, 1.0), BACKOFF_MOST)
                log.warning("write-back: the hub cannot take uploads now (%s); trying again in "
                            "%.0fs", exc, pause)
            if pause:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), pause)
                except TimeoutError:
                    pass

    async def pass_once(self) -> bool:
        """One round of work: True if it did something (look again at once)."""
        did = False
        for ds, path in sorted(self._discards):
            inc = self._incoming.get(ds)
            if inc is None or await asyncio.to_thread(inc.upload, path) is None:
                # Not written again here since: the hub's copy goes.
                status, _, body = await self._client(ds).forward(
                    "DELETE", self._url(ds, path), {}, b"")
                if status == 409:
                    continue  # being received there (a send in flight): after it
                if status >= 400 and status != 404:
                    log.warning("write-back: the hub kept its copy of %s/%s discarded here "
                                "(%d %s); it drops it after a week", ds, path, status,
                                body[:200])
            self._discards.discard((ds, path))
        if time.monotonic() - self._expired_at > EXPIRE_EVERY:
            self._expired_at = time.monotonic()
            for inc in self._known().values():  # uploads no commit took for a week
                await asyncio.to_thread(inc.expire)
        failure: BaseException | None = None
        for ds, inc in self._known().items():
            # One dataset's trouble (its hub down, a refusal) does not hold up the others'.
            try:
                did = await self._dataset_once(ds, inc) or did
            except (SpokeError, OSError, aiohttp.ClientError) as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return did

    async def _dataset_once(self, ds: str, inc: Incoming) -> bool:
        journals = await asyncio.to_thread(inc.pending)
        # Every whole upload to the hub, a few at once (one TCP stream seldom fills a long
        # link), the oldest commit's first; then the commits whose files all are.
        first = [u.path for _, ups in journals for u in ups]
        named = set(first)
        rest = [u["path"] for u in await asyncio.to_thread(inc.listing)
                if u["whole"] and u["path"] not in named]
        did = await self._send_all(ds, inc, [*dict.fromkeys(first), *rest])
        for journal, ups in journals:
            await self._finish(ds, inc, journal, ups)
            did = True
        return did

    def _client(self, ds: str) -> UpstreamClient:
        i = self.metadata.routes.index(ds)
        if i is None:
            raise NotFound(f"dataset {ds!r} is served by no upstream of this spoke")
        return self.clients[i]

    def _url(self, ds: str, path: str = "") -> str:
        base = f"/v1/datasets/{quote(ds)}/uploads"
        return f"{base}/{quote(path)}" if path else base

    async def _hub_state(self, ds: str, path: str) -> dict[str, Any] | None:
        try:
            return await self._client(ds).get_json(self._url(ds, path))
        except NotFound:
            return None

    async def _send_all(self, ds: str, inc: Incoming, paths: list[str]) -> bool:
        """``paths`` sent, ``SENDS_AT_ONCE`` at a time; True if bytes were sent. The first
        failure is raised once the others have ended."""
        room = asyncio.Semaphore(SENDS_AT_ONCE)

        async def one(path: str) -> bool:
            async with room:
                return await self._send(ds, inc, path)

        got = await asyncio.gather(*(one(p) for p in paths), return_exceptions=True)
        for r in got:
            if isinstance(r, BaseException):
                raise r
        return any(got)

    async def _send(self, ds: str, inc: Incoming, path: str) -> bool:
        """``path``'s upload whole at the hub (from the bytes the hub holds); True if bytes
        were sent."""
        up = await asyncio.to_thread(inc.upload, path)
        if up is None or not up.whole or (ds, path, up.version) in self._at_hub:
            return False
        held = await self._hub_state(ds, path)
        offset = 0
        if held is not None and (held["size"], held["version"]) == (up.size, up.version):
            if held["whole"]:
                self._at_hub.add((ds, path, up.version))
                return False
            offset = int(held["received"])
        part = inc.dir / f"{_key(path)}.part"
        headers = {H_SIZE: str(up.size), H_VERSION: up.version, H_OFFSET: str(offset),
                   "Content-Type": "application/octet-stream",
                   "Content-Length": str(up.size - offset)}
        client = self._client(ds)
        resp = await client.open("PUT", self._url(ds, path), headers, _pieces(part, offset,
                                                                              up.size, self))
        try:
            body = await resp.read()
        except aiohttp.ClientError as exc:
            raise error_for_transport(exc, client.base_url) from exc
        finally:
            resp.release()
        if resp.status == 422:
            # The hub's digest disagrees with the one made here on arrival: bytes changed in
            # flight, or on this disk since. Sent again from 0, at once the first times, then
            # only after the backoff (a copy that rotted here would refuse forever).
            n = self._refused[(ds, path)] = self._refused.get((ds, path), 0) + 1
            log.error("write-back of %s/%s: the hub refused its digest %d times (%s); sending "
                      "it again", ds, path, n, body[:200])
            if n >= 3:
                raise SpokeError(f"{ds}/{path}: the hub refused its bytes {n} times: does the "
                                 "spoke's copy still digest to its version?")
            return True
        self._refused.pop((ds, path), None)
        if resp.status >= 400:
            raise_for_status(resp.status, body, f"PUT {path}", final=True)
        if resp.status == 201:  # whole and checked there
            self._at_hub.add((ds, path, up.version))
        return True

    async def _finish(self, ds: str, inc: Incoming, journal: Path, ups: list[Upload]) -> None:
        """A commit journalled here (``ups``: as the journal names them): each file whole
        at the hub, then the hub's commit; once the hub has published it, the local copies
        go."""
        sent = journal.with_suffix(".sent")
        if sent.exists() and await self._landed(ds, ups):
            await self._publish(ds, inc, journal, ups, {"id": None, "recovered": True})
            return
        held = await asyncio.to_thread(lambda: [inc.upload(u.path) for u in ups])
        if any(h is None or (h.version, h.identity) != (u.version, u.identity)
               for h, u in zip(held, ups, strict=True)):
            await asyncio.to_thread(self._failed, inc, journal, ups, "its uploads are not "
                                    "at the spoke as they were committed (removed by hand?)")
            return
        await self._send_all(ds, inc, [u.path for u in ups])  # known whole there: no request
        if any((ds, u.path, u.version) not in self._at_hub for u in ups):
            return  # one is not whole at the hub yet (refused, or cut off): next round
        await asyncio.to_thread(write_durably, sent, b"")
        try:
            doc = await self._client(ds).post_json(f"/v1/datasets/{quote(ds)}/commit",
                                                   {"paths": [u.path for u in ups]})
        except Transient:
            raise  # lost or never sent: the marker makes the next round ask first
        except (Conflict, NotFound, Forbidden, DigestMismatch, BadRequest) as exc:
            if isinstance(exc, NotFound) and not await self._landed(ds, ups):
                # An upload the hub no longer holds (dropped there): sent again next round.
                self._at_hub.difference_update((ds, u.path, u.version) for u in ups)
                return
            if await self._landed(ds, ups):
                doc = {"id": None, "recovered": True}
            elif await self._committing(ds, ups):
                # An earlier send of it is being committed there: asked again shortly.
                await asyncio.sleep(1.0)
                return
            else:
                await asyncio.to_thread(self._failed, inc, journal, ups, str(exc))
                return
        await self._publish(ds, inc, journal, ups, doc)

    async def _publish(self, ds: str, inc: Incoming, journal: Path, ups: list[Upload],
                       doc: dict[str, Any]) -> None:
        """The hub published the commit: recorded as safe at once (``done.jsonl``: ``ckpt
        wait`` returns), then its files into the cache (``keeper``: a read of every byte,
        which the time until safe does not wait for), then the local copies go. A crash
        between: the restart finds the commit landed at the hub and finishes it without a
        second record."""
        await asyncio.to_thread(self._record_done, ds, journal, ups, doc)
        self._safe[(ds, journal)] = frozenset(u.path for u in ups)
        if self.keeper is not None:
            await self.keeper.published(ds, journal.stem, inc.block_size, ups,
                                        {u.path: inc.dir / f"{_key(u.path)}.part" for u in ups})
        await asyncio.to_thread(self._retire, ds, inc, journal, ups)
        self._safe.pop((ds, journal), None)
        log.info("write-back: commit %s of %s published at the hub (%d files)", journal.stem,
                 ds, len(ups))

    async def _committing(self, ds: str, ups: list[Upload]) -> bool:
        """True while the hub is committing any of ``ups``."""
        doc = await self._client(ds).get_json(self._url(ds))
        names = {u.path for u in ups}
        return any(u.get("committing") and u.get("path") in names
                   for u in doc.get("uploads", ()))

    async def _landed(self, ds: str, ups: list[Upload]) -> bool:
        """True when the hub's latest snapshot holds every upload at its version (a commit
        whose answer was lost, or sent before a restart)."""
        client = self._client(ds)
        try:
            m = await client.manifest(ds, "latest")
        except NotFound:
            return False
        have = dict(zip(m.paths, m.versions, strict=True))
        return all(have.get(u.path) == u.version for u in ups)

    def _record_done(self, ds: str, journal: Path, ups: list[Upload], doc: dict[str, Any]
                     ) -> None:
        done = self.root / ds / "done.jsonl"
        if any(d.get("commit") == journal.stem for d in read_done(done)):
            return  # recorded before a crash that came before the local copies went
        line = json.dumps({"commit": journal.stem, "snapshot": doc.get("id"),
                           "files": len(ups), "bytes": sum(u.size for u in ups),
                           "paths": [u.path for u in ups][:1000], "at": time.time(),
                           # what the keeper pins again after a restart (spoke.kept)
                           "versions": [[u.version, u.size] for u in ups]})
        with open(done, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.metadata.forget(ds)  # the primary's reads see the new snapshot at once

    def _retire(self, ds: str, inc: Incoming, journal: Path, ups: list[Upload]) -> None:
        inc.retire([(journal, ups)])
        self._at_hub.difference_update((ds, u.path, u.version) for u in ups)
        journal.with_suffix(".sent").unlink(missing_ok=True)

    def _failed(self, inc: Incoming, journal: Path, ups: list[Upload], why: str) -> None:
        inc._fail(journal, ups, f"the hub refused the commit: {why}", Placed())
        journal.with_suffix(".sent").unlink(missing_ok=True)


async def _pieces(part: Path, offset: int, size: int, wb: WriteBack) -> AsyncIterator[bytes]:
    """The part's bytes from ``offset``, a piece at a time, read off the event loop and past
    the page cache (written so, and read this once); each piece held while readers wait on
    the upstream (``spoke.uploadpace``)."""
    f = await asyncio.to_thread(DirectReader, part, PIECE)
    pacer = UploadPacer()
    try:
        at = offset
        while at < size:
            while (wait := pacer.hold(time.monotonic(), wb.reads_waiting())) > 0:
                await asyncio.sleep(wait)
            piece = await asyncio.to_thread(f.read, at, min(PIECE, size - at))
            if not piece:
                raise SpokeError(f"{part} is shorter than its upload: {at} of {size} bytes")
            at += len(piece)
            wb.sent_bytes += len(piece)
            yield piece
    finally:
        wb.held_s += pacer.held_s
        f.close()


def read_done(path: Path) -> list[dict[str, Any]]:
    """The last ``DONE_KEPT`` commits a ``done.jsonl`` records, oldest first, one per commit."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out: dict[object, dict[str, Any]] = {}
    for line in lines[-DONE_KEPT:]:
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash: the hub holds the truth
        if not isinstance(doc, dict):
            continue
        # A crash between a commit's line and its journal's retirement publishes it again
        # (found already at the hub), which writes a second line: the commit keeps its place
        # (the order is publication's, which retention's "last N" reads) and its last line.
        out[doc.get("commit")] = doc
    return list(out.values())
