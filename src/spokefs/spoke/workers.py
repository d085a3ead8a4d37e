"""``spokefs spoke serve --workers N``: one spoke on every core.

The process the user starts is a small supervisor. It opens N listening sockets on one
port (``SO_REUSEPORT``: the kernel spreads connections over them) and starts N worker
processes: worker 0 is the primary (the whole spoke: store, fetches, planner; it also
listens on ``CACHE_DIR/spoke.sock`` for the others), workers 1..N-1 are replicas
(``spokefs.spoke.replica``: they serve reads from the shared cache and ask the primary for
the rest). It prints the ready line once every worker answers, restarts a worker that dies
(the primary first: it owns the cache), and on SIGTERM or SIGINT stops them all. With
``--audit-log FILE`` the primary writes FILE and replica N writes FILE.worker-N (each its own
reads and refusals; the cache's summaries are the primary's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from spokefs.errors import ConfigError
from spokefs.procs import Child, StartError, cli, die_with_parent
from spokefs.spoke.config import (  # replica_sockets: importable from here too
    SpokeConfig,
    replica_sockets,
    worker_socket,
)

log = logging.getLogger(__name__)

WORKER_READY = "spokefs spoke-worker listening on"
MAX_DEFAULT_WORKERS = 16  # each worker holds its own decoded manifests (up to ~100 MB each)


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_WORKERS))


def config_json(config: SpokeConfig) -> str:
    return json.dumps({k: str(v) if isinstance(v, Path) else v
                       for k, v in dataclasses.asdict(config).items()})


def config_from_json(raw: str) -> SpokeConfig:
    doc = json.loads(raw)
    doc["cache_dir"] = Path(doc["cache_dir"])
    return SpokeConfig(**doc)


def listen_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` listening sockets sharing one port (the first picks it when ``port`` is 0)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            port = s.getsockname()[1]
            s.listen(1024)
            s.set_inheritable(True)
    except OSError as exc:
        for s in socks:
            s.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return socks


class Worker:
    def __init__(self, index: int, sock: socket.socket, config: SpokeConfig,
                 unix_path: Path) -> None:
        self.index = index
        self.sock = sock
        self.config = config
        self.unix_path = unix_path
        self.child: Child | None = None
        self.restarts = 0

    @property
    def role(self) -> str:
        return "primary" if self.index == 0 else "replica"

    @property
    def proc(self) -> subprocess.Popen[str] | None:
        return None if self.child is None else self.child.proc

    def start(self) -> None:
        args = cli("spoke", "_worker", "--role", self.role, "--index", str(self.index),
                   "--listen-fd", str(self.sock.fileno()), "--unix", str(self.unix_path),
                   "--config", config_json(self.config))
        # Its log (stderr) goes where the supervisor's goes; its stdout is relayed, but for
        # the ready line, which only the supervisor reads.
        self.child = Child(args, lambda line: line.startswith(WORKER_READY),
                           name=f"spoke worker {self.index} ({self.role})", merge_stderr=False,
                           on_line=_relay, pass_fds=[self.sock.fileno()], keep_output=False,
                           ).launch()

    def wait_ready(self, timeout: float) -> None:
        assert self.child is not None
        try:
            self.child.wait_ready(timeout)
        except StartError as exc:
            raise ConfigError(f"{exc}\n(see its log above)") from None

    def stop(self, timeout: float = 20.0) -> None:
        if self.child is not None:
            self.child.stop(timeout)


def _relay(line: str) -> None:
    sys.stdout.write(line)
    sys.stdout.flush()


def serve_workers(config: SpokeConfig, host: str, port: int, n: int) -> int:
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    socks = listen_sockets(host, port, n)
    port = socks[0].getsockname()[1]
    unix_path = config.cache_dir / "spoke.sock"
    for old in replica_sockets(config.cache_dir):  # left by an earlier run with more workers
        old.unlink(missing_ok=True)
    # One budget for batch reads, whatever the workers: each holds its share.
    config = dataclasses.replace(config, batch_memory=max(1, config.batch_memory // n))
    workers = [Worker(i, s, config, unix_path) for i, s in enumerate(socks)]
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    def on_hangup(signum: int, _frame: Any) -> None:  # each worker re-reads its token file
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGHUP, on_hangup)
    try:
        workers[0].start()  # the primary opens the store before anyone reads it
        workers[0].wait_ready(120)
        for w in workers[1:]:
            w.start()
        for w in workers[1:]:
            w.wait_ready(60)
        scheme = "https" if config.tls() else "http"
        print(f"spokefs spoke listening on {scheme}://{host}:{port} ({n} workers)", flush=True)
        while not stopping.wait(0.2):
            for w in workers:  # the primary first: replicas wait for it when they ask
                if w.proc is not None and w.proc.poll() is not None and not stopping.is_set():
                    w.restarts += 1
                    log.error("spoke worker %d (%s) exited with %s; restarting it (restart "
                              "%d)", w.index, w.role, w.proc.returncode, w.restarts)
                    time.sleep(min(5.0, 0.2 * w.restarts))
                    w.start()
    finally:
        print("spokefs spoke stopping", file=sys.stderr, flush=True)
        for w in reversed(workers):
            w.stop()
        for s in socks:
            s.close()
    return 0


def run_worker(role: str, index: int, listen_fd: int, unix_path: str, config_raw: str) -> int:
    """A worker process (started by ``serve_workers``)."""
    import asyncio

    from spokefs.wire.run import serve_forever

    die_with_parent()
    config = config_from_json(config_raw)
    sock = socket.socket(fileno=listen_fd)
    if role == "primary":
        from spokefs.spoke.app import build_spoke_app
        from spokefs.spoke.service import SpokeBackend

        app = build_spoke_app(SpokeBackend(config))
        asyncio.run(serve_forever(app, "", 0, "spoke-worker", sock=sock, unix_path=unix_path,
                                  tls=config.tls()))
    else:
        from spokefs.spoke.replica import ReplicaBackend, build_replica_app

        backend = ReplicaBackend(Path(unix_path), config.deadline, config.latest_ttl,
                                 config.read_window)
        # Its own socket, where the primary asks it for its counts before a scrape.
        mine = str(worker_socket(config.cache_dir, index))
        auth = Path(config.auth) if config.auth else None
        # Its own audit file: rotating one file from several processes would lose lines.
        from spokefs.audit import Audit, worker_file

        audit = Audit(worker_file(config.audit_log, index) if config.audit_log else None)
        from spokefs.cache.store import internal_key

        key = internal_key(config.cache_dir)  # the primary made it (or this makes it)
        asyncio.run(serve_forever(build_replica_app(backend, auth, audit, lambda: key,
                                                    config.batch_memory), "", 0,
                                  "spoke-worker", sock=sock, unix_path=mine, tls=config.tls()))
    return 0

