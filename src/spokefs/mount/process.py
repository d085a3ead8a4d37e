"""Mounting from Python code: a ``spokefs mount --foreground`` child process, ready when it
says so; the one lazy unmount and the one "is FUSE usable here" check.

    from spokefs.mount.process import MountProcess, unmount

    with MountProcess("http://127.0.0.1:8471/imagenet", "/mnt/imagenet", "--deadline", "5s"):
        ...  # the mount answers here; leaving the block unmounts (SIGTERM, then lazy umount)

    unmount("/mnt/imagenet")  # clears a mount whose process died (kill -9)

The child prints ``spokefs mount ready: ...`` once a stat has gone through the kernel, so the
mount is usable as soon as ``start()`` returns.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from pathlib import Path

from spokefs.mount import sysfs
from spokefs.procs import Child, StartError, cli

READY_PREFIX = "spokefs mount ready:"


class MountError(StartError):
    """The mount process exited, or did not become ready in time; carries its output."""


def mount_command(url: str, mountpoint: str | os.PathLike[str], *extra: str) -> list[str]:
    return cli("mount", "--foreground", *extra, url, str(mountpoint))


class MountProcess(Child):
    """One foreground mount process; ``start()`` returns when the mount answers."""

    def __init__(self, url: str, mountpoint: str | os.PathLike[str], *extra: str,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(mount_command(url, mountpoint, *extra),
                         lambda line: line.startswith(READY_PREFIX),
                         name=f"mount of {url} at {mountpoint}", env=env or {})
        self.url = url
        self.mountpoint = Path(mountpoint)

    def start(self, timeout: float = 60.0) -> MountProcess:
        try:
            super().start(timeout)
        except StartError as exc:
            raise MountError(str(exc)) from None
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the mount unmounts itself); a lazy unmount if anything is left."""
        super().stop(timeout)
        unmount(self.mountpoint)

    def __enter__(self) -> MountProcess:
        return self.start() if self.proc is None else self


def unmount(mountpoint: str | os.PathLike[str]) -> bool:
    """Detach a FUSE mount lazily, even if busy or dead (``fusermount3 -u -z``, else
    ``umount -l``); False if nothing was mounted, OSError with the tool's message if it
    cannot. Mount state comes from /proc/self/mountinfo: ``os.path.ismount`` says False for
    a dead FUSE mount (its stat fails), which is the one most in need of clearing."""
    if not sysfs.is_mounted(mountpoint):
        return False
    last = ""
    for cmd in (["fusermount3", "-u", "-z", str(mountpoint)],
                ["umount", "-l", str(mountpoint)]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            continue
        if r.returncode == 0:
            return True
        last = (r.stderr or r.stdout).strip()
    raise OSError(errno.EBUSY, last or "neither fusermount3 nor umount is installed")


def wait_mounted(mountpoint: Path, proc: subprocess.Popen[bytes] | None,
                 timeout: float) -> None:
    """Wait for another program's mount (a benchmark peer's) to appear; MountError if its
    process exits first or nothing is mounted within ``timeout``."""
    end = time.monotonic() + timeout
    while not sysfs.is_mounted(mountpoint):
        if proc is not None and proc.poll() is not None:
            raise MountError(f"the mount at {mountpoint} exited with {proc.returncode}")
        if time.monotonic() > end:
            raise MountError(f"nothing mounted at {mountpoint} after {timeout:g}s")
        time.sleep(0.05)  # another process's mount: nothing to block on


def fuse_unusable(need_pyfuse3: bool = True) -> str | None:
    """Why a FUSE mount cannot work here (None when it can): tests skip and benchmarks
    leave the mount out with this reason. /dev/fuse is opened, not just looked for: in a
    container it may exist and still be refused. ``need_pyfuse3=False``: for another program's
    mount (rclone), which needs the kernel side and fusermount3 only."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"cannot open /dev/fuse: {exc.strerror or exc}"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    if need_pyfuse3:
        try:
            import pyfuse3  # noqa: F401
        except ImportError as exc:
            return f"pyfuse3 is not importable: {exc}"
    return None
