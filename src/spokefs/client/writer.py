"""Files opened for writing on a spokefs URL: ``spokefs.open(URL, "wb")`` and
``fsspec.open("spokefs://...", "wb")`` (so DCP's ``FsspecWriter`` saves to a spokefs URL).

The bytes go to a local staging file as they are written (``SPOKEFS_STAGING``, else the
system's temporary folder); ``close()`` uploads the file (``Uploader.put``: digested,
resumable) and returns once the endpoint holds it durably: a spoke's disk (write-back: the
hub gets it behind) or the hub's. A file is published when a commit names it: at once for
``spokefs.open(..., "wb")`` (``commit=True``), or, for the fsspec filesystem, when its
folder's commit marker is written (``.metadata``, the one DCP writes last), so a reader
never sees half a checkpoint.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from spokefs.client.uploads import Uploader


def staging_dir() -> str:
    return os.environ.get("SPOKEFS_STAGING") or tempfile.gettempdir()


class UploadFile(io.FileIO):
    """A local staging file, uploaded as ``path`` of ``uploader``'s dataset when closed;
    ``closed_with(path, staged)`` is then told where the staged bytes are (it owns them:
    keep them or unlink them). An upload that fails raises from ``close()``, and the staged
    bytes stay, named in the error, so nothing written is lost."""

    def __init__(self, uploader: Uploader, path: str,
                 closed_with: Callable[[str, Path], None] | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="spokefs-", suffix=".part", dir=staging_dir())
        os.close(fd)
        super().__init__(name, "w+b")
        self.uploader = uploader
        self.path = path
        self.staged = Path(name)
        self._closed_with = closed_with
        self._uploaded = False

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
        else:  # the writer failed: what it wrote is not the file it meant; nothing is sent
            self.abandon()

    def __del__(self) -> None:
        # Never uploaded from the garbage collector: a file nobody closed was not finished.
        if not self.closed:
            self.abandon()

    def abandon(self) -> None:
        """Closed without uploading; the staged bytes go."""
        self._uploaded = True
        super().close()
        self.staged.unlink(missing_ok=True)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self._uploaded:
            return
        try:
            self.uploader.put(self.path, self.staged)
        except BaseException as exc:
            exc.add_note(f"spokefs: the bytes written to {self.path!r} are kept at "
                         f"{self.staged}")
            raise
        self._uploaded = True
        if self._closed_with is not None:
            self._closed_with(self.path, self.staged)
        else:
            self.staged.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"<spokefs upload {self.path!r} of {self.uploader.dataset!r}>"


class _Abandons:
    """A wrapper of an ``UploadFile`` (``_upload`` finds it): a with-block that fails, or
    the garbage collector, abandons it instead of uploading."""

    def _upload(self) -> UploadFile:
        raise NotImplementedError

    def __del__(self) -> None:
        if not self.closed:  # type: ignore[attr-defined]
            self._upload().abandon()

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()  # type: ignore[attr-defined]
        else:
            self._upload().abandon()


class BufferedUpload(_Abandons, io.BufferedWriter):
    """``UploadFile`` buffered."""

    def _upload(self) -> UploadFile:
        raw = self.raw
        assert isinstance(raw, UploadFile)
        return raw


class TextUpload(_Abandons, io.TextIOWrapper):
    """``UploadFile`` as text."""

    def _upload(self) -> UploadFile:
        raw = self.buffer.raw  # type: ignore[attr-defined]
        assert isinstance(raw, UploadFile)
        return raw
