"""``spokefs.open(url)``: a seekable, read-only binary file pinned to one snapshot."""

from __future__ import annotations

import io

from spokefs.client.sync import Client
from spokefs.client.urls import parse_url
from spokefs.errors import NotFound


class RemoteFile(io.RawIOBase):
    """Raw reads of one file version; wrap in io.BufferedReader (``open`` does)."""

    def __init__(self, client: Client, dataset: str, version: str, size: int,
                 name: str = "", snapshot: str | None = None) -> None:
        super().__init__()
        self.client = client
        self.dataset = dataset
        self.version = version
        self.size = size
        self.name = name
        self.snapshot = snapshot
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.size - self._pos)
        if n <= 0:
            return 0
        data = self.client.read(self.dataset, self.version, self._pos, self._pos + n,
                                self.snapshot)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        if self._pos >= self.size:
            return b""
        data = self.client.read(self.dataset, self.version, self._pos, self.size,
                                self.snapshot)
        self._pos += len(data)
        return data


def open(url: str, mode: str = "rb", buffering: int = 1024 * 1024,
         deadline: float = 30.0) -> io.BufferedReader | RemoteFile:
    """Open ``http://host:port/<dataset>[@<snapshot>]/<path>`` for reading.

    The snapshot is resolved once (``latest`` by default) and the file stays pinned to the
    version it had there. ``buffering=0`` returns the raw file.
    """
    if mode not in ("rb", "r"):
        raise ValueError(f"spokefs files are read-only; mode {mode!r} is not supported")
    u = parse_url(url)
    if not u.path:
        raise NotFound(f"{url} names a dataset, not a file")
    client = Client(u.base, deadline=deadline)
    e = client.entry(u.dataset, u.snapshot, u.path)
    if e.get("type") != "file":
        raise IsADirectoryError(f"{url} is a folder")
    raw = RemoteFile(client, u.dataset, str(e["version"]), int(e["size"]), name=url,
                     snapshot=e.get("snapshot"))
    f: io.BufferedReader | RemoteFile = raw if buffering == 0 else io.BufferedReader(
        raw, buffer_size=buffering)
    if mode == "r":
        return io.TextIOWrapper(f)  # type: ignore[return-value]
    return f
