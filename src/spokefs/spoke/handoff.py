"""The spoke's side of a same-host handoff (the exchange: ``spokefs.client.handoff``): a
writable mount on this host gives a finished file by descriptor on ``CACHE_DIR/handoff.sock``,
and the primary copies it into its write-back (``Incoming.adopt``) with one read, no HTTP
body on either side.

A new way in, so it is held to the HTTP route's rules, and more:
- the token is checked as ``PUT .../uploads/PATH`` checks it (``write:DS`` or admin; no
  token without ``--auth``, as over HTTP). The socket is not ``spoke.sock``: a process that
  reaches it is not one of the spoke's own;
- the dataset's name and the path as the route checks them, the quota as ``receive`` does;
- the descriptor must be a regular file of the size declared, not on a FUSE filesystem (a
  read of a FUSE file waits on its daemon, which may be this spoke's own mount, or hostile),
  and unchanged while it is copied.
Refusals are logged and audited as the HTTP route's are, with the peer's pid and uid.

Threads, not the event loop: the accept loop, and one thread per connection (at most
``MOST_AT_ONCE``) that checks on the loop (tokens, the hub's word on the dataset), then
copies in its own thread, so a long copy holds none of the threads reads use.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Any

from spokefs.audit import Audit
from spokefs.client.handoff import MAX_MESSAGE, socket_path
from spokefs.errors import BadRequest, Forbidden, SpokeError, Transient, Unauthorized
from spokefs.hub.uploads import check_upload_path
from spokefs.spoke.writeback import WriteBack
from spokefs.wire.auth import TokenFile
from spokefs.wire.authz import check_write
from spokefs.wire.paths import check_dataset_name

log = logging.getLogger(__name__)

MOST_AT_ONCE = 16    # connections served at once; more wait in the listen backlog
ASK_TIMEOUT_S = 30.0  # seconds a connection may take to send its request
CHECK_TIMEOUT_S = 120.0  # seconds the loop's checks may take (the hub asked about the dataset)
FUSE_TYPES = ("fuse", "fuseblk")  # and "fuse.NAME": filesystems served by a daemon


def fs_type(fd: int) -> str:
    """The filesystem type of the mount ``fd``'s file lies on (``/proc``: the descriptor's
    ``mnt_id``, looked up in this process's mount table)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        mnt = next(line.split()[1] for line in f if line.startswith("mnt_id:"))
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split(" ", 1)[0] == mnt:
                return line.split(" - ", 1)[1].split()[0]
    raise OSError(errno.ENOENT, f"mount {mnt} of descriptor {fd} is not in this process's "
                  "mount table")


def check_file(fd: int) -> None:
    """BadRequest unless ``fd`` is a regular file the spoke may read without waiting on
    another daemon."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise BadRequest("a handoff gives a regular file's descriptor, opened for reading")
    kind = fs_type(fd)
    if kind in FUSE_TYPES or kind.startswith("fuse."):
        raise BadRequest(f"a handoff's file may not lie on a FUSE filesystem ({kind}): send "
                         "it over HTTP")


class HandoffServer:
    """The handoff socket of a spoke's primary worker."""

    def __init__(self, cache_dir: Path, writeback: WriteBack, tokens: TokenFile | None,
                 audit: Audit, loop: asyncio.AbstractEventLoop) -> None:
        self.path = socket_path(cache_dir)
        self.wb, self.tokens, self.audit, self.loop = writeback, tokens, audit, loop
        self._room = threading.BoundedSemaphore(MOST_AT_ONCE)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listening; without the socket (a path too long for one, a read-only folder),
        writers send over HTTP, and the log says why."""
        self.path.unlink(missing_ok=True)  # left by a run before (the cache's lock is held)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.bind(str(self.path))
            s.listen(64)
        except OSError as exc:
            s.close()
            log.warning("handoff: cannot listen on %s (%s); same-host writers send over HTTP",
                        self.path, exc)
            return
        self._sock = s
        self._thread = threading.Thread(target=self._accept, name="spokefs-handoff",
                                        daemon=True)
        self._thread.start()
        log.info("handoff: same-host writers hand files over on %s", self.path)

    def close(self) -> None:
        """No new connections; copies under way finish in their own threads, or end with
        the process (a copy never whole is never sent: it is written whole or dropped)."""
        if self._sock is None:
            return
        self.path.unlink(missing_ok=True)
        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()
        if self._thread is not None:
            self._thread.join(5)

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            self._room.acquire()
            try:
                conn, _ = self._sock.accept()
            except OSError:
                self._room.release()
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="spokefs-handoff-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            with conn:
                conn.settimeout(ASK_TIMEOUT_S)
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                try:
                    msg, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
                except TimeoutError:
                    return
                if not msg and not fds:
                    return  # connected, sent nothing
                conn.settimeout(None)  # the copy takes what it takes
                answer = self._answer(msg, fds, flags, f"unix pid {pid} uid {uid}")
                try:
                    conn.send(json.dumps(answer).encode())
                except OSError:
                    pass  # the writer went away: it sends over HTTP, or hands it again
        finally:
            for fd in fds:
                os.close(fd)
            self._room.release()

    def _answer(self, msg: bytes, fds: list[int], flags: int, peer: str) -> dict[str, Any]:
        ds = path = token_name = None
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 1:
                raise BadRequest("a handoff is one JSON request of at most "
                                 f"{MAX_MESSAGE} bytes with one descriptor")
            try:
                ask = json.loads(msg)
                ds, path = check_dataset_name(ask["dataset"]), check_upload_path(ask["path"])
                size, token = ask["size"], ask.get("token")
            except (ValueError, KeyError, TypeError) as exc:
                raise BadRequest(f"a handoff's request is JSON with dataset, path, size and "
                                 f"token: {exc}") from exc
            if not isinstance(size, int) or isinstance(size, bool):
                raise BadRequest(f"a handoff's size is a count of bytes, not {size!r}")
            if token is not None and not isinstance(token, str):
                raise BadRequest("a handoff's token is a string or null")
            if self.tokens is not None:
                who = self.tokens.check(f"Bearer {token}" if token else None)
                token_name = who.name
                check_write(who, ds)
            check_file(fds[0])
            inc = asyncio.run_coroutine_threadsafe(self.wb.admit(ds, path, size),
                                                   self.loop).result(CHECK_TIMEOUT_S)
            done = inc.adopt(path, fds[0], size)
            self.loop.call_soon_threadsafe(self.wb.adopted, size)
            return {"status": 201, "dataset": ds, **done}
        except SpokeError as exc:
            if isinstance(exc, Unauthorized | Forbidden):
                self.audit.write("refused", token=token_name, method="HANDOFF",
                                 path=f"/v1/datasets/{ds}/uploads/{path}", status=exc.status,
                                 remote=peer, reason=str(exc)[:500])
            log.warning("handoff of %s/%s from %s refused (%d): %s", ds, path, peer,
                        exc.status, exc)
            return {"status": exc.status, **exc.to_json()}
        except Transient as exc:  # the hub unreachable, and this dataset never written here
            log.warning("handoff of %s/%s from %s: %s", ds, path, peer, exc)
            return {"status": 503, "error": {"code": "upstream_unavailable",
                                             "message": f"{ds}: {exc}"}}
        except Exception as exc:  # a disk error, a check that timed out: the writer's EIO
            log.exception("handoff of %s/%s from %s failed", ds, path, peer)
            return {"status": 500, "error": {"code": "internal",
                                             "message": f"the spoke could not copy it in: {exc}"}}
