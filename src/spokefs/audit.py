"""The audit log (``--audit-log FILE``): who read what, what was refused, and what a spoke's
cache took in, evicted and purged. One JSON object a line (docs/security.md, "Audit log").

Lines are written by a thread (QueueHandler + QueueListener), so a request never waits for
the disk; the file rotates at 64 MiB, five old files kept (FILE.1 .. FILE.5). Rotation is
safe in one process only, so every process of a spoke writes its own file (FILE for the
primary, FILE.worker-N for replica worker N). A token is never written, only its name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import os
import queue
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from spokefs.cache.store import BlockStore, Loc
    from spokefs.policy import BlockKey
    from spokefs.tasks import Tasks

__all__ = ["Audit", "CacheAudit", "worker_file"]

MAX_BYTES = 64 << 20
BACKUPS = 5
ENV_INTERVAL = "SPOKEFS_AUDIT_INTERVAL"  # seconds between cache summaries (default 10)
MAX_LISTED = 64  # versions named in one batch read's line (their count is always there)


def worker_file(path: str, index: int) -> str:
    """The audit file of a spoke's replica worker ``index``: rotation is unsafe when several
    processes share one file."""
    return f"{path}.worker-{index}"


class Audit:
    """Writes audit records; with no file, every call does nothing (call sites need no if)."""

    def __init__(self, path: str | Path | None = None, max_bytes: int = MAX_BYTES,
                 backups: int = BACKUPS) -> None:
        self.path = None if path is None else Path(path)
        self.enabled = path is not None
        self.cache: CacheAudit | None = None  # set by watch_store
        self._listener: logging.handlers.QueueListener | None = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes,
                                                       backupCount=backups, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        # Its own logger, unknown to logging's registry and not propagating: audit lines
        # never reach the operational log, and its handlers never see operational lines.
        self._logger = logging.Logger(f"spokefs.audit.{self.path}", logging.INFO)
        self._logger.propagate = False
        self._logger.addHandler(logging.handlers.QueueHandler(q))
        self._listener = logging.handlers.QueueListener(q, handler)
        self._listener.start()

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        doc = {"ts": round(time.time(), 6), "event": event, **fields}
        self._logger.info(json.dumps(doc, separators=(",", ":")))

    # -- what the servers log ----------------------------------------------------------------
    def read(self, request: web.Request, dataset: str, nbytes: int | None, status: int,
             path: str | None = None, version: str | Iterable[str] | None = None,
             complete: bool = True, **extra: Any) -> None:
        """A read answered (``nbytes``: body bytes handed to the connection; None: not
        known, for a batch cut off midway)."""
        if not self.enabled or _internal(request):
            return  # a replica's pass-through read: the replica logs it itself
        fields: dict[str, Any] = {"token": _token_name(request), "dataset": dataset}
        if path is not None:
            fields["path"] = path
        if isinstance(version, str) or version is None:
            fields["version"] = version
        else:
            versions = sorted(set(version))
            fields["version"] = versions[:MAX_LISTED]
            fields["versions"] = len(versions)
        fields.update(bytes=nbytes, status=status, remote=_remote(request), **extra)
        if not complete:
            fields["complete"] = False  # the client left, or the read failed, mid-body
        self.write("read", **fields)

    def admin(self, request: web.Request, status: int) -> None:
        """An operator action answered (purge, warm-up, unpin, snapshot, residency,
        inventory): who asked what, and how it ended."""
        if self.enabled and not _internal(request):  # a replica logs what it forwards
            self.write("admin", token=_token_name(request), method=request.method,
                       path=request.path, status=status, remote=_remote(request))

    def refused(self, request: web.Request, status: int, reason: str,
                token: str | None = None) -> None:
        """A 401 or 403. ``reason`` is the message the client got (it names tokens, never
        their secrets)."""
        self.write("refused", token=token, method=request.method, path=request.path,
                   status=status, remote=_remote(request), reason=reason[:500])

    def watch_store(self, store: BlockStore, tasks: Tasks) -> None:
        """Summaries of what ``store`` cached, evicted and purged (after the service has
        set the store's event callbacks: it chains onto them)."""
        if self.enabled:
            self.cache = CacheAudit(self, store)
            tasks.keep(self.cache.run, "audit-cache")

    def purging(self, keys: Iterable[BlockKey]) -> None:
        """These blocks are about to be purged (their removals are recorded as such)."""
        if self.cache is not None:
            self.cache.purging(keys)

    def close(self) -> None:
        if self._listener is not None:
            self.enabled = False
            self._listener.stop()  # writes what is queued
            for h in self._listener.handlers:
                h.close()
            self._listener = None


def _token_name(request: web.Request) -> str | None:
    token = request.get("token")
    return None if token is None else token.name


def _internal(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def _remote(request: web.Request) -> str | None:
    return "unix" if _internal(request) else request.remote


class CacheAudit:
    """Per dataset, blocks and bytes cached, evicted and purged, one line each every
    interval: a fill of a million blocks is a few lines, not a million.

    The store says which block arrived (with its dataset and size) or left (the key only).
    Why it left: a purge names its blocks first (``purging``); an eviction removes blocks
    and then counts them (``on_evict(n)``, before the loop turns); anything else (a damaged
    block, a dataset's time-to-live or rules) is ``dropped``. A removed block's dataset is
    known from a map of the resident versions (bounded by what the store holds), its size
    from its object's size and the dataset's block size."""

    def __init__(self, audit: Audit, store: BlockStore, interval: float | None = None) -> None:
        self.audit = audit
        self.store = store
        self.interval = interval or float(os.environ.get(ENV_INTERVAL, "10"))
        # version -> [dataset, resident blocks]: the dataset of a block when it leaves
        self._versions: dict[str, list[Any]] = {}
        self._block_size: dict[str, int] = {}  # dataset -> largest block seen (its size)
        self._counts: dict[tuple[str, str | None], list[int]] = {}  # (event, ds) -> [n, bytes]
        self._removed: list[tuple[str | None, int]] = []  # not yet told apart
        self._purging: set[BlockKey] = set()
        for key in store.keys():  # noqa: SIM118 (a store, not a dict); once, at start
            loc = store.get(key)
            if loc is not None:
                self._arrived(key, loc)
        ev = store.events
        ev.changed.append(self._changed)
        evict = ev.on_evict

        def on_evict(n: int) -> None:
            evict(n)
            self._evicted(n)

        ev.on_evict = on_evict

    def purging(self, keys: Iterable[BlockKey]) -> None:
        self._purging.update(keys)

    def _arrived(self, key: BlockKey, loc: Loc) -> None:
        entry = self._versions.get(key[0])
        if entry is None:
            self._versions[key[0]] = [loc.dataset, 1]
        else:
            entry[1] += 1
        if loc.size > self._block_size.get(loc.dataset, 0):
            self._block_size[loc.dataset] = loc.size

    def _changed(self, key: BlockKey, loc: Loc | None) -> None:
        if loc is not None:
            self._arrived(key, loc)
            self._add("cached", loc.dataset, loc.size)
            return
        version, index = key
        entry = self._versions.get(version)
        ds = None if entry is None else entry[0]
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._versions[version]
        bs = self._block_size.get(ds, 0) if ds is not None else 0
        size = self.store.object_size(version)
        nbytes = max(0, min(bs, size - index * bs)) if size is not None and bs else bs
        if key in self._purging:
            self._purging.discard(key)
            self._add("purged", ds, nbytes)
        else:
            self._removed.append((ds, nbytes))

    def _evicted(self, n: int) -> None:
        # The last n removals were this eviction's; any before them were dropped.
        cut = max(0, len(self._removed) - n)
        for ds, nbytes in self._removed[cut:]:
            self._add("evicted", ds, nbytes)
        del self._removed[cut:]
        self._dropped()

    def _dropped(self) -> None:
        for ds, nbytes in self._removed:
            self._add("dropped", ds, nbytes)
        self._removed.clear()

    def _add(self, event: str, ds: str | None, nbytes: int) -> None:
        c = self._counts.get((event, ds))
        if c is None:
            self._counts[(event, ds)] = [1, nbytes]
        else:
            c[0] += 1
            c[1] += nbytes

    def flush(self) -> None:
        self._dropped()  # an eviction counts its blocks before the loop turns: these were not
        # A purge in progress keeps its names; a block gone before it was reached does not.
        self._purging = {k for k in self._purging if k in self.store}
        counts, self._counts = self._counts, {}
        for (event, ds), (n, nbytes) in sorted(counts.items(), key=lambda x: (x[0][0],
                                                                              x[0][1] or "")):
            self.audit.write(event, dataset=ds, blocks=n, bytes=nbytes,
                             interval=self.interval)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                self.flush()
        finally:  # at shutdown: what the last interval saw
            self.flush()
