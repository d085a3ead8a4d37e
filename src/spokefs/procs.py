"""Child processes that say when they are ready: the one launcher behind the spoke's workers,
``MountProcess`` (mounting from Python code), the demo, the benchmarks and the tests.

A child is ready when it prints a line its ``ready`` test accepts. Its output is read by a
thread from the start, so the child never blocks on a full pipe, and readiness is waited for
with a deadline: a child that exits, or says nothing, fails ``start`` with ``StartError``
naming what happened and showing its last lines, never a hang.

    with Service(hub_args(data, state)) as hub:   # ``spokefs hub serve ...``, port 0
        ...  # hub.url answers here
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

TAIL_LINES = 20  # of a child's output, shown when it fails to start
_READY = re.compile(r"^spokefs (\w+) listening on (\S+)(?: control (\S+))?")


class StartError(RuntimeError):
    """A child that exited, or was not ready in time; the message carries its last lines."""


def cli(*args: str) -> list[str]:
    """The command line of ``spokefs ARGS...`` run by this interpreter."""
    return [sys.executable, "-m", "spokefs.cli", *args]


class Child:
    """One child process, ready once it prints a line ``ready`` accepts.

    ``merge_stderr``: stderr joins the captured output (False: it goes where this process's
    goes, as a supervisor's workers log). ``on_line`` hears every line but the ready one;
    ``log_path`` gets them all. ``lines`` keeps the whole output, for tests and reports, or
    with ``keep_output=False`` only what came before the ready line (a child that runs for
    months must not grow this process). ``new_session``: its own session, so a terminal's
    Ctrl-C reaches only this process, which stops the child itself.
    """

    def __init__(self, args: Sequence[str], ready: Callable[[str], bool], *,
                 name: str = "", env: dict[str, str] | None = None,
                 log_path: Path | None = None, merge_stderr: bool = True,
                 on_line: Callable[[str], None] | None = None,
                 pass_fds: Sequence[int] = (), keep_output: bool = True,
                 new_session: bool = False) -> None:
        self.args = list(args)
        self.name = name or " ".join(self.args[3:] if self.args[1:3] == ["-m", "spokefs.cli"]
                                     else self.args)
        self.env = None if env is None else {**os.environ, **env}
        self.log_path = log_path
        self.merge_stderr = merge_stderr
        self.on_line = on_line
        self.pass_fds = tuple(pass_fds)
        self.keep_output = keep_output
        self.new_session = new_session
        self._ready_test = ready
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.ready_line = ""
        self._ready = threading.Event()
        self._eof = threading.Event()

    def launch(self) -> Child:
        """Start the child and its reader; ``wait_ready`` waits for its ready line."""
        self._ready.clear()
        self._eof.clear()
        self.ready_line = ""
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if self.merge_stderr else None, text=True, bufsize=1,
            env=self.env, pass_fds=self.pass_fds, start_new_session=self.new_session)
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True,
                         name=f"drain-{self.proc.pid}").start()
        return self

    def start(self, timeout: float = 60.0) -> Child:
        self.launch()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Return once ready; else kill the child and raise StartError within ``timeout``."""
        assert self.proc is not None, "launch() first"
        end = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                self._eof.wait(1.0)  # its last lines say why it exited
                why = f"exited with status {self.proc.returncode} before it was ready"
            elif time.monotonic() > end:
                why = f"printed no ready line within {timeout:g}s"
            else:
                continue
            self.kill()
            raise StartError(f"{self.name} {why}; its last output:\n{self.tail()}")

    def tail(self, n: int = TAIL_LINES) -> str:
        return "".join(self.lines[-n:]).rstrip() or "(nothing)"

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        # Always read the pipe, so the child never blocks writing a log line.
        assert proc.stdout is not None
        with (self.log_path.open("a") if self.log_path else contextlib.nullcontext()) as log:
            for line in proc.stdout:
                if self.keep_output or not self._ready.is_set():
                    self.lines.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                if not self._ready.is_set() and self._ready_test(line):
                    self.ready_line = line.strip()
                    self._ready.set()
                elif self.on_line is not None:
                    self.on_line(line)
        self._eof.set()

    @property
    def output(self) -> list[str]:
        return self.lines

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the child has exited and all its output is read."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self._eof.wait(timeout)
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Child:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Service(Child):
    """A ``spokefs ...`` service; ``url`` (and ``control``, for a link) are set from its ready
    line, ``spokefs ROLE listening on URL [control URL]``."""

    def __init__(self, args: list[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(cli(*args), lambda line: _READY.match(line) is not None,
                         env=env, log_path=log_path)
        self.url = ""
        self.control = ""

    def start(self, timeout: float = 60.0) -> Service:
        super().start(timeout)
        m = _READY.match(self.ready_line)
        assert m is not None
        self.url = m.group(2) if m.group(2).startswith("http") else f"http://{m.group(2)}"
        self.control = m.group(3) or ""
        return self

    def __enter__(self) -> Service:
        return self.start() if self.proc is None else self

    @property
    def hostport(self) -> str:
        return self.url.split("://", 1)[1].rstrip("/")

    @property
    def port(self) -> int:
        return int(self.hostport.rsplit(":", 1)[1])


@contextlib.contextmanager
def running(*services: Service) -> Iterator[tuple[Service, ...]]:
    """Start ``services`` in order; stop the started ones in reverse, whatever happens."""
    started: list[Service] = []
    try:
        for s in services:
            started.append(s.start())
        yield services
    finally:
        for s in reversed(started):
            s.stop()


def die_with_parent() -> None:
    """Make this process die with the one that started it (``PR_SET_PDEATHSIG``): a spoke's
    workers and private hub must not outlive it, even after a ``kill -9``. The signal comes
    when the thread that started this process exits: launch from a long-lived thread."""
    import ctypes
    import ctypes.util

    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def hub_args(directory: Path, state_dir: Path, port: int = 0) -> list[str]:
    return ["hub", "serve", str(directory), "--port", str(port), "--state-dir", str(state_dir)]


def spoke_args(upstream: str, cache_dir: Path, cache_size: str, port: int = 0,
               *extra: str) -> list[str]:
    return ["spoke", "serve", "--upstream", upstream, "--cache-dir", str(cache_dir),
            "--cache-size", cache_size, "--port", str(port), "--no-fsync", *extra]
