"""The store's one worker thread: block writes to segment files and batched index commits.

The event loop owns the index (in memory) and never waits on the disk: it hands the worker
jobs (write these blocks there, then tell me) and queues index rows (insert, delete, facts:
``spokefs.cache.index``), and goes on. The worker runs jobs as they come and commits the
queued rows in one transaction at most every ``commit_every`` seconds, so a block costs no
commit of its own (``commit_soon`` moves a commit forward, for a fact a restart must find).
With ``fsync``, the segment files written since the last commit are flushed before the commit,
so a row never becomes durable before its bytes. Either way a crash can only leave rows whose
bytes are missing or torn, and the digest check on every read turns those into misses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from spokefs.cache.index import BlockIndex

log = logging.getLogger(__name__)

Job = Callable[[], Any]


class StoreWorker:
    """Runs ``submit``ted jobs in order and commits the index's queued rows in batches, in
    one thread."""

    def __init__(self, index: BlockIndex, fsync: bool,
                 on_index_error: Callable[[Exception], None],
                 commit_every: float = 0.05) -> None:
        self.index = index
        self.fsync = fsync
        self.commit_every = commit_every
        self.on_index_error = on_index_error
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._dirty_fds: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="spokefs-store", daemon=True)
        self._closing = False

    def start(self) -> None:
        self._thread.start()

    # -- from the event loop -----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Run ``job()`` in the worker (it reports back by itself)."""
        self._jobs.put(job)

    def wrote(self, fd: int) -> None:
        """A segment file was written (worker thread): flush it before the next commit."""
        if self.fsync:
            self._dirty_fds.add(fd)

    def commit_soon(self) -> None:
        """Commit what is queued as the worker's next job, not at the next tick (a fact a
        restart must find even after a kill -9 a moment later); does not wait."""
        self._jobs.put(self._commit)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every job submitted and every row queued so far is done and committed
        (not from the worker thread)."""
        if not self._thread.is_alive():
            self._commit()
            return
        done = threading.Event()

        def commit_now() -> None:
            self._commit()
            done.set()

        self._jobs.put(commit_now)
        done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._closing = True
            self._jobs.put(None)
            self._thread.join(30)
        else:
            self._commit()

    # -- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_commit = time.monotonic() + self.commit_every
        while True:
            timeout = max(0.0, next_commit - time.monotonic())
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                job = None
                if self._closing:
                    break
            else:
                if job is None and self._closing:
                    self._commit()
                    break
            if job is not None:
                try:
                    job()
                except Exception:  # a job reports its own errors; this is a bug
                    log.exception("cache: a store job failed")
            if time.monotonic() >= next_commit:
                self._commit()
                next_commit = time.monotonic() + self.commit_every

    def _commit(self) -> None:
        try:
            self.index.commit(before=self._flush_files)
        except sqlite3.Error as exc:
            # A full index volume: the rows are lost, which only costs refetches (a row
            # missing for bytes written is an orphan region, freed at the next open).
            self.on_index_error(exc)

    def _flush_files(self) -> None:
        for fd in list(self._dirty_fds):
            with contextlib.suppress(OSError):
                os.fdatasync(fd)
        self._dirty_fds.clear()
