"""Mounting from Python code: a ``spokefs mount --foreground`` child process, ready when it
says so.

    from spokefs.mount.process import MountProcess, unmount

    with MountProcess("http://127.0.0.1:8471/imagenet", "/mnt/imagenet", "--deadline", "5s"):
        ...  # the mount answers here; leaving the block unmounts (SIGTERM, then lazy umount)

    unmount("/mnt/imagenet")  # clears a mount whose process died (kill -9)

The child prints ``spokefs mount ready: ...`` once a stat has gone through the kernel, so the
mount is usable as soon as ``start()`` returns.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from spokefs.mount import sysfs

READY_PREFIX = "spokefs mount ready:"


class MountError(RuntimeError):
    """The mount process exited, or did not become ready in time; carries its output."""


def mount_command(url: str, mountpoint: str | os.PathLike[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "spokefs.cli", "mount", "--foreground", *extra, url,
            str(mountpoint)]


class MountProcess:
    """One foreground mount process; ``start()`` returns when the mount answers."""

    def __init__(self, url: str, mountpoint: str | os.PathLike[str], *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.url = url
        self.mountpoint = Path(mountpoint)
        self.args = mount_command(url, mountpoint, *extra)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.ready_line = ""

    def start(self, timeout: float = 60.0) -> MountProcess:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, env=self.env, bufsize=1)
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if self.proc.poll() is not None else f"not ready in {timeout:g}s"
                self.kill()
                raise MountError(f"mount of {self.url} at {self.mountpoint} {why}:\n"
                                 + "".join(self.output))
        return self

    def _drain(self, ready: threading.Event) -> None:
        # Always read the pipe, so the mount never blocks writing a log line.
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith(READY_PREFIX):
                self.ready_line = line.strip()
                ready.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the mount unmounts itself); a lazy unmount if anything is left."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if sysfs.is_mounted(self.mountpoint):
            unmount(self.mountpoint)

    def kill(self) -> None:
        """SIGKILL, as a crash would: the mountpoint stays dead until ``unmount``."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> MountProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def unmount(mountpoint: str | os.PathLike[str]) -> bool:
    """Lazily unmount (live, busy or dead mounts alike); False if nothing was mounted."""
    from spokefs.mount.run import lazy_unmount

    if not sysfs.is_mounted(mountpoint):
        return False
    lazy_unmount(Path(mountpoint))
    return True


def fuse_unusable() -> str | None:
    """Why a FUSE mount cannot work here (None when it can): tests skip and benchmarks
    leave the mount out with this reason."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"cannot open /dev/fuse: {exc.strerror or exc}"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        return f"pyfuse3 is not importable: {exc}"
    return None
