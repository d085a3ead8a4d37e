"""Starting spokefs services as real processes for benchmarks and the demo."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_READY = re.compile(r"^spokefs (\w+) listening on (\S+)(?: control (\S+))?")


class Service:
    """A ``spokefs ...`` service in its own process; ``url`` is set once its ready line
    (``spokefs ROLE listening on URL [control URL]``) is printed."""

    def __init__(self, args: list[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "spokefs.cli", *args]
        self.env = None if env is None else {**os.environ, **env}
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.control = ""
        self.lines: list[str] = []

    def start(self, timeout: float = 60.0) -> Service:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, env=self.env)
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _READY.match(line)
            if m:
                self.url = m.group(2) if m.group(2).startswith("http") else f"http://{m.group(2)}"
                self.control = m.group(3) or ""
                break
            if time.monotonic() > end:
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"{' '.join(self.args[2:])} failed to start:\n"
                               + "".join(self.lines[-20:]))
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        log = self.log_path.open("a") if self.log_path else None
        for line in self.proc.stdout:
            self.lines.append(line)
            if log:
                log.write(line)
                log.flush()
        if log:
            log.close()

    @property
    def port(self) -> int:
        return int(self.hostport.rsplit(":", 1)[1])

    @property
    def output(self) -> list[str]:
        return self.lines

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def hostport(self) -> str:
        return self.url.split("://", 1)[1].rstrip("/")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def running(*services: Service) -> Iterator[tuple[Service, ...]]:
    started: list[Service] = []
    try:
        for s in services:
            started.append(s.start())
        yield services
    finally:
        for s in reversed(started):
            s.stop()


def hub_args(directory: Path, state_dir: Path, port: int = 0) -> list[str]:
    return ["hub", "serve", str(directory), "--port", str(port), "--state-dir", str(state_dir)]


def spoke_args(upstream: str, cache_dir: Path, cache_size: str, port: int = 0,
               *extra: str) -> list[str]:
    return ["spoke", "serve", "--upstream", upstream, "--cache-dir", str(cache_dir),
            "--cache-size", cache_size, "--port", str(port), "--no-fsync", *extra]
