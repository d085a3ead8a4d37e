"""The kernel knobs of a FUSE mount: its backing device (bdi) and readahead, and mount state.

FUSE cannot raise its own readahead during INIT (the kernel caps it at the bdi's current
value, 128 KiB by default), so root sets ``/sys/class/bdi/<major:minor>/read_ahead_kb`` after
mounting. Everything here reads /proc/self/mountinfo instead of stat'ing the mountpoint: a stat
would be answered by the very process asking, which may not be serving requests yet.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

BDI_ROOT = Path("/sys/class/bdi")
_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_entry(mountpoint: str | os.PathLike[str],
                mountinfo: str | None = None) -> tuple[str, str] | None:
    """(major:minor, fstype) of the topmost mount at ``mountpoint``, or None if not mounted."""
    target = os.path.abspath(mountpoint)
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 7 or _unescape(fields[4]) != target:
            continue
        try:
            fstype = fields[fields.index("-", 6) + 1]
        except (ValueError, IndexError):
            fstype = ""
        found = (fields[2], fstype)  # later lines are mounted on top of earlier ones
    return found


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    return mount_entry(mountpoint) is not None


def read_ahead_path(mountpoint: str | os.PathLike[str]) -> Path | None:
    entry = mount_entry(mountpoint)
    return None if entry is None else BDI_ROOT / entry[0] / "read_ahead_kb"


def set_read_ahead_kb(mountpoint: str | os.PathLike[str], kb: int) -> int | None:
    """Set the mount's readahead; the value now in effect, or None if it could not be set
    (not root, no sysfs): reads still work, in smaller requests."""
    path = read_ahead_path(mountpoint)
    if path is None:
        log.warning("readahead: %s is not in /proc/self/mountinfo", mountpoint)
        return None
    try:
        path.write_text(f"{kb}\n")
        return int(path.read_text())
    except OSError as exc:
        log.warning("readahead: cannot set %s to %d KiB (%s); the kernel will ask for "
                    "small reads (run as root for full speed)", path, kb, exc.strerror)
        return None
