"""A spoke straight on a bucket: ``spokefs spoke serve --upstream s3://bucket/prefix``.

The spoke's fetcher speaks the hub protocol (batch reads, digests with every block), and the
hub over a bucket (``hub/bucket.py``) already turns a bucket into it: listings pinned by
ETag/VersionId as snapshots, conditional ranged GETs, block digests made as blocks arrive. So
the spoke's supervisor runs one as a private child, ``spokefs hub serve s3://... --state-dir
CACHE_DIR/bucket-hub`` on loopback, and makes it the upstream; everything built on the spoke
works unchanged on top. The cost is a loopback hop per block (docs/s3.md measures it).

- The supervisor holds the hub's listening socket and hands it down (``--listen-fd``): a hub
  restarted after a crash answers on the same address. While no hub runs (it crashed, or
  cannot start because the bucket is down), the supervisor answers on that socket itself,
  at once, 503 ``upstream_unavailable``: the spoke then serves what it has cached and retries
  the rest until its deadline, as with a hub that is down, rather than wait on a backlog.
- A spoke whose cache already knows the bucket starts even when the bucket is down (its hub
  is retried in the background); a new one stops with the hub's error (credentials, bucket).
- The hub requires a token (a fresh one per start, in files readable by this user only):
  other users of the host cannot read the bucket through it.
- It dies with the supervisor (``PR_SET_PDEATHSIG``), is restarted if it exits, and is
  stopped after the spoke.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import select
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from spokefs.errors import ConfigError
from spokefs.procs import Child, StartError, cli

log = logging.getLogger(__name__)

HUB_DIR = "bucket-hub"   # in the cache folder: the hub's state (listings, digests, manifests)
READY_TIMEOUT = 900.0    # the hub lists the bucket before it is ready: a million keys take minutes
MAX_BACKOFF = 10.0       # seconds between restarts of a hub that keeps failing (bucket down)
_READY = "spokefs hub listening on "


class PrivateHub:
    """A bucket hub for this spoke only, as a child process on 127.0.0.1."""

    def __init__(self, source: str, cache_dir: Path, *, name: str | None = None,
                 endpoint_url: str | None = None, block_size: int | None = None) -> None:
        self.source = source
        self.state_dir = cache_dir / HUB_DIR
        self.token_file = self.state_dir / "spoke.token"
        self.tokens = self.state_dir / "hub.tokens"
        self.extra: list[str] = []
        if name is not None:
            self.extra += ["--name", name]
        if endpoint_url is not None:
            self.extra += ["--endpoint-url", endpoint_url]
        if block_size is not None:
            self.extra += ["--block-size", str(block_size)]
        self.sock: socket.socket | None = None
        self.child: Child | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._down = threading.Event()  # no hub answers: the supervisor says 503 itself
        self._lock = threading.Lock()  # no launch after stop() began
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self.sock is not None
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def start(self) -> PrivateHub:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        _write_private(self.tokens, f"spoke admin {token}\n")  # admin: snapshots are forwarded
        _write_private(self.token_file, f"{token}\n")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.sock.setblocking(False)  # the hub, accepting on it too, may take a connection first
        known = (self.state_dir / "state.sqlite").exists()  # listed before, by an earlier run
        self._launch()
        try:
            self._wait_ready()
        except StartError as exc:
            if not known:
                self.stop()
                raise ConfigError(f"the spoke's hub on {self.source} did not start (its "
                                  "output is above)") from None
            log.error("%s; serving what is cached, retrying in the background",
                      str(exc).splitlines()[0])
            self._down.set()
        threading.Thread(target=self._answer_while_down, daemon=True,
                         name="bucket-hub-down").start()
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="bucket-hub-watch")
        self._watcher.start()
        return self

    def _launch(self) -> None:
        assert self.sock is not None
        args = cli("hub", "serve", self.source, "--host", "127.0.0.1", "--port", "0",
                   "--state-dir", str(self.state_dir), "--auth", str(self.tokens),
                   "--listen-fd", str(self.sock.fileno()), "--die-with-parent", *self.extra)
        with self._lock:
            if self._stopping.is_set():
                return
            # Its output goes to the spoke's stderr (its ready line stays here: the spoke's
            # own is the one scripts read); only what it says before it is ready is kept.
            self.child = Child(args, lambda line: line.startswith(_READY),
                               name=f"bucket hub ({self.source})", on_line=_relay,
                               pass_fds=[self.sock.fileno()], keep_output=False,
                               new_session=True).launch()

    def _wait_ready(self) -> None:
        if self.child is not None:
            self.child.wait_ready(READY_TIMEOUT)

    def _watch(self) -> None:
        """Restart the hub when it exits (this thread launches it: the hub's parent-death
        signal is tied to the launching thread, which lives as long as the spoke)."""
        failures = 0
        while not self._stopping.wait(0.5):
            child = self.child
            if child is None or (child.alive() and not self._down.is_set()):
                continue
            self._down.set()
            self.restarts += 1
            log.error("the spoke's bucket hub exited with status %s; restarting it (restart "
                      "%d)", child.proc.returncode if child.proc else None, self.restarts)
            if self._stopping.wait(min(MAX_BACKOFF, 0.5 * (failures + 1))):
                return
            self._launch()
            try:
                self._wait_ready()
                self._down.clear()
                failures = 0
            except StartError as exc:
                failures += 1
                if not self._stopping.is_set():
                    log.error("%s", str(exc).splitlines()[0])

    def _answer_while_down(self) -> None:
        """Answer 503 on the hub's socket while no hub is there to (see the module doc)."""
        assert self.sock is not None
        sock = self.sock
        while not self._stopping.is_set():
            if not self._down.wait(0.5):
                continue
            try:
                ready, _, _ = select.select([sock], [], [], 0.2)
                if not ready or not self._down.is_set():
                    continue
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue  # a hub that came back took it
            except (OSError, ValueError):
                return  # closed by stop()
            threading.Thread(target=_refuse, args=(conn, self.source), daemon=True).start()

    def stop(self, timeout: float = 15.0) -> None:
        self._stopping.set()
        with self._lock:
            child = self.child
        if child is not None:
            child.stop(timeout)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout)
        if self.sock is not None:
            self.sock.close()


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # also when it existed with wider modes
        f.write(text)


def _refuse(conn: socket.socket, source: str) -> None:
    """One 503 ``upstream_unavailable`` answer, then close (the spoke retries it)."""
    body = json.dumps({"error": {
        "code": "upstream_unavailable",
        "message": f"the bucket {source} cannot be read now: its hub is not running "
                   "(restarting; see the spoke's log)"}}).encode()
    try:
        conn.settimeout(2.0)
        got = b""
        while b"\r\n\r\n" not in got and len(got) < 65536:
            chunk = conn.recv(65536)
            if not chunk:
                return
            got += chunk
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                     b"\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):  # drain a request body, so the answer is not reset away
            pass
    except OSError:
        pass
    finally:
        conn.close()


def _relay(line: str) -> None:
    sys.stderr.write(line)
    sys.stderr.flush()


def serve_on_bucket(args: argparse.Namespace,
                    serve: Callable[[argparse.Namespace], int]) -> int:
    """Run ``serve`` (the spoke, one process or a supervisor of workers) with a private hub
    on the bucket ``args.upstream`` (its only one) as its upstream."""
    if args.upstream_token_file:
        raise ConfigError("--upstream-token-file is for a hub or spoke upstream; a bucket's "
                          "credentials are found the way AWS tools find them (docs/s3.md)")
    bucket = args.upstream[0]
    hub = PrivateHub(bucket, args.cache_dir, name=args.name,
                     endpoint_url=args.endpoint_url, block_size=args.block_size).start()
    try:
        log.info("spoke on %s through its own bucket hub at %s", bucket, hub.url)
        args.upstream = [hub.url]
        args.upstream_token_file = [hub.token_file]
        args.name = args.endpoint_url = args.block_size = None  # the hub's, handed down
        return serve(args)
    finally:
        hub.stop()
