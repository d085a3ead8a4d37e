"""Unix socket paths of any length.

A socket's path must fit ``sun_path`` (108 bytes on Linux), and a spoke keeps its workers'
sockets in its cache folder, which may be deep. A longer path is given to the kernel through
this process's descriptor of its folder (``/proc/self/fd/N/NAME``): the socket still lives,
with its folder's permissions, where the path says.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_PATH = 100  # bytes left of sun_path's 108, with room for the kernel's NUL
_folders: dict[str, int] = {}  # folder -> an O_PATH descriptor of it, kept for the process


def unix_address(path: str | Path) -> str:
    """``path``, or an equivalent short enough to bind or connect to."""
    text = os.fspath(path)
    if len(os.fsencode(text)) <= MAX_PATH:
        return text
    folder, name = os.path.split(os.path.abspath(text))
    fd = _folders.get(folder)
    if fd is None:
        fd = _folders[folder] = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{name}"
