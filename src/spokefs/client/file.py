"""``spokefs.open(url)``: a seekable, read-only binary file pinned to one snapshot."""

from __future__ import annotations

import io
from pathlib import Path

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
    """Open ``http://host:port/<dataset>[@<snapshot>]/<path>`` for reading, or (``"wb"``,
    ``"w"``) for writing into a writable dataset.

    Reading: the snapshot is resolved once (``latest`` by default) and the file stays pinned
    to the version it had there. ``buffering=0`` returns the raw file.

    Writing (``spokefs.client.writer``): the bytes are staged locally; ``close()`` uploads
    the file to the spoke (or hub) named, and returns once it holds it durably, then
    publishes it as a commit of its own. A spoke uploads it to the hub behind
    (``spokefs.checkpoint.wait_safe``). To publish several files together, use
    ``Uploader`` or the ``spokefs://`` filesystem's commit marker (docs/checkpoints.md).
    """
    if mode in ("wb", "w"):
        return _open_write(url, mode, buffering, deadline)  # type: ignore[return-value]
    if mode not in ("rb", "r"):
        raise ValueError(f"mode {mode!r} is not supported: rb or r to read, wb or w to write")
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


def _open_write(url: str, mode: str, buffering: int, deadline: float) -> io.IOBase:
    from spokefs.client.uploads import Uploader
    from spokefs.client.writer import BufferedUpload, TextUpload, UploadFile

    u = parse_url(url)
    if u.snapshot != "latest":
        raise ValueError(f"{url}: a write goes to the dataset, not to a snapshot "
                         f"(@{u.snapshot})")
    if not u.path:
        raise NotFound(f"{url} names a dataset, not a file")
    up = Uploader(u.base, u.dataset, deadline=deadline)
    up.check_writable()  # a read-only dataset fails here, not at close
    up.find_handoff()  # on the spoke's host: handed over by descriptor, not sent

    def publish(path: str, staged: Path) -> None:
        staged.unlink(missing_ok=True)
        up.commit(paths=[path])

    raw = UploadFile(up, u.path, publish)
    if mode == "w":
        return TextUpload(BufferedUpload(raw, buffer_size=max(buffering, 1)))
    return raw if buffering == 0 else BufferedUpload(raw, buffer_size=buffering)
