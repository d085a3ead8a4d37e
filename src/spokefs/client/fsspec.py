"""The ``spokefs://host:port/<dataset>[@<snapshot>]/<path>`` fsspec filesystem.

Registered as an fsspec entry point (see pyproject), so ``fsspec.open("spokefs://...")`` and
``fsspec.filesystem("spokefs")`` work. Listing and ``info`` come from the snapshot's manifest
(one request per snapshot, then local), bytes from ranged reads of the pinned versions.

``spokefs://`` speaks plain http unless the filesystem is made with ``use_https=True`` (the
name webhdfs gives the same option): ``fsspec.open("spokefs://spoke:8471/ds/x",
use_https=True)``, ``fsspec.filesystem("spokefs", use_https=True)``; the certificate is checked
against the system's authorities or ``SPOKEFS_CA_BUNDLE`` (``spokefs.wire.tls``).

Errors are the builtin ones: a missing file or dataset is a ``FileNotFoundError``, a token
refused a ``PermissionError``, a spoke out of reach past ``deadline`` a ``ConnectionError``
(``spokefs.errors``).
"""

from __future__ import annotations

from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from spokefs.client.sync import Client
from spokefs.client.urls import DatasetURL, parse_url
from spokefs.manifest import Manifest


class SpokeFileSystem(AbstractFileSystem):
    protocol = "spokefs"
    root_marker = ""

    def __init__(self, deadline: float = 30.0, use_https: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deadline = deadline
        self.use_https = use_https
        self._manifests: dict[tuple[str, str, str], Manifest] = {}

    # paths are "host:port/dataset[@snap]/path" once the protocol is stripped
    def _split(self, path: str) -> tuple[Client, DatasetURL, Manifest]:
        u = parse_url(self._strip_protocol(path),
                      default_scheme="https" if self.use_https else "http")
        client = Client(u.base, deadline=self.deadline)
        key = (u.base, u.dataset, u.snapshot)
        m = self._manifests.get(key)
        if m is None:
            m = client.manifest(u.dataset, u.snapshot)
            self._manifests[key] = m
            # Pin: later "latest" paths of this filesystem keep reading this snapshot.
            self._manifests[(u.base, u.dataset, m.snapshot)] = m
        return client, u, m

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if isinstance(path, list):  # fsspec passes lists sometimes
            return [cls._strip_protocol(p) for p in path]  # type: ignore[return-value]
        return path.removeprefix("spokefs://").rstrip("/")

    def _prefix(self, u: DatasetURL) -> str:
        host = u.base.split("://", 1)[1]
        ref = u.dataset if u.snapshot == "latest" else f"{u.dataset}@{u.snapshot}"
        return f"{host}/{ref}"

    def _file_info(self, u: DatasetURL, e: Any) -> dict[str, Any]:
        return {"name": f"{self._prefix(u)}/{e.path}", "size": e.size, "type": "file",
                "mode": e.mode, "mtime": e.mtime_ns / 1e9, "version": e.version}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        _, u, m = self._split(path)
        e = m.lookup(u.path) if u.path else None
        if e is not None:
            out = [self._file_info(u, e)]
        elif u.path == "" or m.is_dir(u.path):
            dirs, files = m.listdir(u.path)
            base = f"{self._prefix(u)}/{u.path}".rstrip("/")
            out = [{"name": f"{base}/{d}", "size": 0, "type": "directory"} for d in dirs]
            out += [self._file_info(u, f) for f in files]
        else:
            raise FileNotFoundError(path)
        return out if detail else [o["name"] for o in out]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        _, u, m = self._split(path)
        e = m.lookup(u.path) if u.path else None
        if e is not None:
            return self._file_info(u, e)
        if u.path == "" or m.is_dir(u.path):
            return {"name": f"{self._prefix(u)}/{u.path}".rstrip("/"), "size": 0,
                    "type": "directory"}
        raise FileNotFoundError(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        client, u, m = self._split(path)
        e = m.lookup(u.path)
        if e is None:
            raise FileNotFoundError(path)
        s = 0 if start is None else (start if start >= 0 else max(0, e.size + start))
        t = e.size if end is None else (end if end >= 0 else e.size + end)
        t = min(t, e.size)
        if t <= s:
            return b""
        return client.read(u.dataset, e.version, s, t, m.snapshot)

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None,
              autocommit: bool = True, cache_options: Any = None, **kwargs: Any
              ) -> AbstractBufferedFile:
        if mode != "rb":
            raise PermissionError("spokefs is read-only")
        return SpokeFile(self, path, mode, block_size or 1024 * 1024, cache_options=cache_options,
                         **kwargs)


class SpokeFile(AbstractBufferedFile):
    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)
