"""When a config file changed: its (inode, size, mtime) by ``os.stat``, polled.

``os.stat`` follows links, so a kubelet's update of a ConfigMap volume (the files are links
through ``..data``, which it switches to a new folder by a rename) is a change too. One
helper for every file a server re-reads: the hub's --config, the spoke's --dataset-config,
the token files of --auth.
"""

from __future__ import annotations

import os
from pathlib import Path

Stamp = tuple[int, int, int]


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def file_stamp(path: Path | str) -> Stamp | None:
    """The file's stamp now; None when it cannot be stat'ed (gone, for now)."""
    try:
        return stamp_of(os.stat(path))
    except OSError:
        return None
