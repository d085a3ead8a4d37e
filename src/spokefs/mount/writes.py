"""A writable native mount's uploads (``spokefs mount --writable``): the Python half of
``native/mount/src/writes.rs``.

The daemon stages what is written into files under the staging folder and asks, one request
per file operation (never per write): ``put`` (a close or fsync of a file with new bytes),
``rename`` and ``discard``. Each is done here with the client's resumable uploads
(``spokefs.client.uploads.Uploader``) against the spoke the mount reads from, and answered
with 0 or an errno; the FUSE request that asked waits for the answer, so ``close()`` and
``fsync()`` return once the spoke holds the file durably. A file named like the commit marker
(``.metadata`` by default) publishes its folder, every rank's uploads in it, as one commit;
the answer names that folder so the daemon drops its staging copies.
"""

from __future__ import annotations

import errno
import logging
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spokefs.client.uploads import Uploader
from spokefs.errors import (
    Conflict,
    Forbidden,
    NoSpace,
    NotFound,
    SpokeError,
    Unauthorized,
)

log = logging.getLogger(__name__)

WAIT_STEP = 0.5   # seconds a take waits; the thread ends once the mount is closed
UPLOADS_AT_ONCE = 8  # ranks closing their shards together upload together


def errno_of(exc: BaseException) -> int:
    """The errno a writer's close or rename sees for a failed upload."""
    if isinstance(exc, NoSpace):
        return errno.ENOSPC
    if isinstance(exc, Forbidden | Unauthorized):
        return errno.EACCES
    if isinstance(exc, Conflict):
        return errno.EEXIST
    if isinstance(exc, NotFound):
        return errno.ENOENT
    if isinstance(exc, OSError) and exc.errno and not isinstance(exc, SpokeError):
        return exc.errno
    return errno.EIO


class MountWrites:
    """Answers one native mount's write requests until the mount is closed."""

    def __init__(self, mount: Any, uploader: Uploader, commit_marker: str | None) -> None:
        self.mount = mount
        self.up = uploader  # its handoff set where the spoke is on this host
        self.marker = commit_marker
        # Files handed over by descriptor, and sent over HTTP (for the log at unmount).
        self.handed = self.sent = 0
        self._counted = threading.Lock()  # the upload threads count together
        self._pool = ThreadPoolExecutor(UPLOADS_AT_ONCE, thread_name_prefix="spokefs-upload")
        self._thread = threading.Thread(target=self._run, name="spokefs-writes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.handed or self.sent:
            log.info("mount: %d files handed to the spoke by descriptor, %d sent over HTTP",
                     self.handed, self.sent)

    def _run(self) -> None:
        while (asks := self.mount.take_writes(WAIT_STEP)) is not None:
            for ask in asks:
                self._pool.submit(self._answer, *ask)

    def _answer(self, id: int, kind: str, path: str, to: str | None, staged: str | None,
                uploaded: bool) -> None:
        try:
            committed = self.handle(kind, path, to, staged, uploaded)
        except Exception as exc:  # every failure is the writer's errno, and a log line
            code = errno_of(exc)
            log.error("mount: %s of %r failed (%s): %s", kind, path, errno.errorcode.get(code),
                      exc)
            self.mount.answer_write(id, code, None)
            return
        self.mount.answer_write(id, 0, committed)

    def handle(self, kind: str, path: str, to: str | None, staged: str | None,
               uploaded: bool) -> str | None:
        """Do one request; the folder committed with it ("dir/"), if any."""
        if kind == "discard":
            self._discard(path)
            return None
        assert staged is not None
        target = to if kind == "rename" and to is not None else path
        self._put(target, Path(staged))
        if kind == "rename" and uploaded:
            self._discard(path)
        return self._maybe_commit(target)

    def _put(self, path: str, staged: Path) -> None:
        """``staged`` held whole by the spoke as ``path``: handed over by descriptor where
        the spoke is on this host, else (or where it cannot take it) sent over HTTP."""
        sent = self.up.put(path, staged)
        with self._counted:
            if sent.handed:
                self.handed += 1
            else:
                self.sent += 1

    def _discard(self, path: str) -> None:
        try:
            self.up.discard(path)
        except NotFound:
            pass  # never arrived, or gone already: nothing to drop

    def _maybe_commit(self, path: str) -> str | None:
        if not self.marker or posixpath.basename(path) != self.marker:
            return None
        folder = posixpath.dirname(path)
        if not folder:
            raise Forbidden(f"{path}: a commit marker at the dataset's root would commit every "
                            "upload in it; write the checkpoint into a folder")
        prefix = f"{folder}/"
        self.up.commit(prefix=prefix)
        log.info("mount: published %s (its commit marker %s arrived)", prefix, self.marker)
        return prefix
