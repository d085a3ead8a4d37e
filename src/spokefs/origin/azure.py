"""An Azure Blob Storage container as an origin (``az://CONTAINER/PREFIX``), through obstore
(Rust object_store) for listing and conditional ranged reads.

The storage account comes from ``AZURE_STORAGE_ACCOUNT_NAME`` and the credentials from what
object_store reads (``AZURE_STORAGE_ACCOUNT_KEY``, a SAS token, a service principal, a
managed identity); ``--endpoint-url`` points at another endpoint (Azurite, sovereign
clouds). Reads are If-Match the listed ETag, so an overwritten blob answers 410.

Not tested here: no Azure emulator can be had from PyPI or Debian (Azurite is an npm
package). object_store's listing drops a trailing ``/`` and empty parts of names, so a
folder marker blob lists as an empty file of that name (left out when it is also a folder).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spokefs.errors import ConfigError
from spokefs.origin.base import (
    BucketUrl,
    ObjectInfo,
    ObjectStoreOrigin,
    check_endpoint,
    obstore_options,
)

if TYPE_CHECKING:
    import obstore


class AzureOrigin(ObjectStoreOrigin):
    def __init__(self, url: BucketUrl, endpoint: str | None = None) -> None:
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise ConfigError("serving an az:// container needs obstore: pip install "
                              "'spokefs[s3]'") from None
        self.url = url
        self.endpoint = check_endpoint(endpoint) if endpoint else None
        self.where = (f"container {url.bucket!r}" if self.endpoint is None
                      else f"container {url.bucket!r} at {self.endpoint}")
        self._store: obstore.store.AzureStore | None = None

    def _reader(self) -> obstore.store.AzureStore:
        if self._store is None:
            from obstore.store import AzureStore

            kw: dict[str, Any] = {}
            if self.endpoint is not None:
                kw["endpoint"] = self.endpoint
            http = bool(self.endpoint and self.endpoint.startswith("http://"))
            try:
                self._store = AzureStore(self.url.bucket, **obstore_options(http), **kw)
            except Exception as exc:  # obstore's configuration errors (no account, ...)
                raise ConfigError(f"cannot use {self.where}: {exc}") from None
        return self._store

    def check(self) -> None:
        next(iter(self._list(1)), None)

    def list(self, versions: bool = False) -> Iterator[ObjectInfo]:
        return self._list(1000)

    def _list(self, chunk: int) -> Iterator[ObjectInfo]:
        import obstore
        from obstore.exceptions import BaseError

        try:
            for batch in obstore.list(self._reader(), self.url.prefix or None,
                                      chunk_size=chunk):
                for m in batch:
                    yield ObjectInfo(m["path"], m["size"], m["e_tag"] or "", m["version"],
                                     int(m["last_modified"].timestamp() * 1e9))
        except BaseError as exc:
            raise ConfigError(f"listing {self.where} failed: {type(exc).__name__}") from None
