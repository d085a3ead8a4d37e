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

Writing into a writable dataset (``spokefs.client.writer``): ``open(path, "wb")`` stages
the bytes and uploads the file when it is closed. Files are published together when their
folder's ``commit_marker`` is written or renamed into place (``.metadata`` by default: the
file torch.distributed.checkpoint writes last, as ``.metadata.tmp`` renamed), as one commit
of every upload under that folder, every rank's included. So ``dcp.save(state,
storage_writer=FsspecWriter("spokefs://spoke:8471/ckpt/step-100"))`` publishes step-100
whole. ``mv`` and ``rm`` take only files this filesystem wrote and has not yet committed
(it keeps those of at most ``KEEP_FOR_RENAME`` bytes for a rename); ``makedirs`` does
nothing (a folder appears with its files). On the spoke's own host a closed file is handed
to the spoke by descriptor instead of sent (``spokefs.client.handoff``): where the spoke's
status names its cache folder to the token, or ``spoke_cache=DIR`` says where it is.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from spokefs.client.sync import Client
from spokefs.client.uploads import Uploader
from spokefs.client.urls import DatasetURL, parse_url
from spokefs.manifest import Manifest

KEEP_FOR_RENAME = 64 << 20  # bytes of a written file kept staged until it is committed


class SpokeFileSystem(AbstractFileSystem):
    protocol = "spokefs"
    root_marker = ""

    def __init__(self, deadline: float = 30.0, use_https: bool = False,
                 commit_marker: str | None = ".metadata", spoke_cache: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deadline = deadline
        self.use_https = use_https
        self.commit_marker = commit_marker
        self.spoke_cache = None if spoke_cache is None else Path(spoke_cache)
        self._manifests: dict[tuple[str, str, str], Manifest] = {}
        # Written here, not yet committed: (base, dataset, path) -> the staged copy, or None
        # once dropped (too large to keep for a rename).
        self._written: dict[tuple[str, str, str], Path | None] = {}
        self._uploaders: dict[tuple[str, str], Uploader] = {}

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
              ) -> Any:
        if mode in ("wb", "xb"):
            return self._open_write(path)
        if mode != "rb":
            raise PermissionError(f"spokefs opens files rb or wb, not {mode}")
        return SpokeFile(self, path, mode, block_size or 1024 * 1024, cache_options=cache_options,
                         **kwargs)

    # -- writing (spokefs.client.writer) -----------------------------------------------------
    def _writing(self, path: str) -> tuple[Uploader, DatasetURL]:
        u = parse_url(self._strip_protocol(path),
                      default_scheme="https" if self.use_https else "http")
        if u.snapshot != "latest" or not u.path:
            raise PermissionError(f"{path}: a write names a file of the dataset, not of a "
                                  "snapshot")
        up = self._uploaders.get((u.base, u.dataset))
        if up is None:
            up = Uploader(u.base, u.dataset, deadline=self.deadline)
            up.check_writable()  # a read-only dataset fails at open, not at close
            up.find_handoff(self.spoke_cache)  # on the spoke's host: by descriptor
            self._uploaders[(u.base, u.dataset)] = up
        return up, u

    def _open_write(self, path: str) -> Any:
        from spokefs.client.writer import UploadFile

        up, u = self._writing(path)
        if self.commit_marker and u.path == self.commit_marker:
            raise PermissionError(f"{path}: a commit marker at the dataset's root would commit "
                                  "every upload in it; write the checkpoint into a folder")

        def closed(name: str, staged: Path) -> None:
            self._kept(u, name, staged)
            if self.commit_marker and posixpath.basename(name) == self.commit_marker:
                self._commit(up, u, name)

        return UploadFile(up, u.path, closed)

    def _kept(self, u: DatasetURL, name: str, staged: Path) -> None:
        keep = staged.stat().st_size <= KEEP_FOR_RENAME
        if not keep:
            staged.unlink(missing_ok=True)
        old = self._written.get((u.base, u.dataset, name))
        if old is not None and old != staged:
            old.unlink(missing_ok=True)
        self._written[(u.base, u.dataset, name)] = staged if keep else None

    def _commit(self, up: Uploader, u: DatasetURL, marker: str) -> None:
        """Every upload under the marker's folder, published together."""
        folder = posixpath.dirname(marker)
        up.commit(prefix=f"{folder}/")
        # Reads of "latest" through this filesystem see the new snapshot from now on.
        for key in [k for k in self._manifests if k[:2] == (u.base, u.dataset)]:
            del self._manifests[key]
        for key in [k for k in self._written
                    if k[:2] == (u.base, u.dataset) and k[2].startswith(f"{folder}/")]:
            staged = self._written.pop(key)
            if staged is not None:
                staged.unlink(missing_ok=True)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        up, u = self._writing(path1)
        _, v = self._writing(path2)
        if (v.base, v.dataset) != (u.base, u.dataset):
            raise PermissionError(f"{path1} -> {path2}: a rename stays in one dataset")
        staged = self._written.get((u.base, u.dataset, u.path))
        if staged is None:
            raise PermissionError(f"{path1}: spokefs renames only a file this filesystem wrote "
                                  f"and has not committed, of at most {KEEP_FOR_RENAME} bytes")
        up.put(v.path, staged)
        up.discard(u.path)
        self._written.pop((u.base, u.dataset, u.path))
        self._kept(v, v.path, staged)
        if self.commit_marker and posixpath.basename(v.path) == self.commit_marker:
            self._commit(up, v, v.path)

    rename = mv

    def rm_file(self, path: str) -> None:
        up, u = self._writing(path)
        key = (u.base, u.dataset, u.path)
        if key not in self._written:
            raise PermissionError(f"{path}: spokefs removes only a file this filesystem wrote "
                                  "and has not committed")
        up.discard(u.path)
        staged = self._written.pop(key)
        if staged is not None:
            staged.unlink(missing_ok=True)

    def rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None
           ) -> None:
        for p in [path] if isinstance(path, str) else path:
            self.rm_file(p)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing to do: a folder appears with the files written into it."""

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Nothing to do: a folder appears with the files written into it."""


class SpokeFile(AbstractBufferedFile):
    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)
