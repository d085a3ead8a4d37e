"""The seam between a hub and where a dataset's bytes live (an ``Origin``).

An origin lists a tree (each file's size, mode, mtime and identity), tells a file's identity
now, and reads a range of a file only while it still has the identity it was listed with. Two
kinds: a folder (``origin/folder.py``: identity is device, inode, size, mtime, ctime) and an
object store (this module's ``ObjectStoreOrigin``: identity is key, size, ETag and the store's
version or generation), for S3 (``origin/s3.py``), Google Cloud Storage (``origin/gcs.py``) and
Azure Blob (``origin/azure.py``). The hub's one ledger (``hub/snapshot.py``) and one backend
(``hub/backend.py``) work over either: a folder's version ids digest content (it is hashed
when snapshotted), an object store's name the listing (digests are made as blocks are read).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from spokefs.errors import ConfigError, UpstreamUnavailable, VersionGone

if TYPE_CHECKING:
    import obstore

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0   # seconds: a dead endpoint fails fast, the reader's deadline decides
REQUEST_TIMEOUT = 120.0  # a whole GET of one block, however slow the link
RETRIES = 3             # the store's own retries of 5xx and dropped connections
RETRY_TIMEOUT = 10.0    # no retry starts after this (the spoke retries past it, to its deadline)

# The URL schemes of object stores, and what each is called in messages.
SCHEMES = {"s3": "S3", "gs": "Google Cloud Storage", "az": "Azure Blob Storage"}
# S3's and GCS's rules for a bucket name, and Azure's for a container (3-63 of lower-case
# letters, digits, '.', '-'); '_' and upper case are allowed for old buckets and some stores.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}")


class Origin(Protocol):
    """Where a hub reads a dataset from. ``list`` and ``identity`` block (a thread)."""

    source: str          # what status shows: a folder's path, a store's URL
    content_ids: bool    # True: versions digest content (hashed at snapshot time)

    def check(self) -> None: ...  # ConfigError when it cannot be used (missing, refused)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object as listed: its identity is (key, size, etag[, version_id])."""

    key: str
    size: int
    etag: str
    version_id: str | None   # S3's VersionId, GCS's generation, Azure's version id
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class BucketUrl:
    """``s3://bucket/prefix`` (or ``gs://``, ``az://``): ``prefix`` is "" (the whole bucket)
    or ends with "/", so ``s3://b/train`` holds ``train/x`` but not ``training/x``."""

    bucket: str
    prefix: str
    scheme: str = "s3"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def default_name(self) -> str:
        """The dataset's name unless ``--name``: the prefix's last part, else the bucket."""
        parts = [p for p in self.prefix.split("/") if p]
        return parts[-1] if parts else self.bucket


def is_store_url(source: str) -> bool:
    return source.partition("://")[0] in SCHEMES and "://" in source


def parse_store_url(source: str) -> BucketUrl:
    scheme, sep, rest = source.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ConfigError(f"{source!r} is not an object store URL (s3://, gs:// or az:// "
                          "BUCKET/PREFIX)")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(f"invalid bucket name {bucket!r} in {source!r}")
    prefix = prefix.strip("/")
    return BucketUrl(bucket, f"{prefix}/" if prefix else "", scheme)


def obstore_options(allow_http: bool = False) -> dict[str, Any]:
    """The client and retry settings of every obstore store here (``S3Store(...,
    **obstore_options())``): the timeouts and retries above; ``allow_http`` for an
    ``http://`` endpoint (an emulator)."""
    client: dict[str, Any] = {"connect_timeout": timedelta(seconds=CONNECT_TIMEOUT),
                              "timeout": timedelta(seconds=REQUEST_TIMEOUT)}
    if allow_http:
        client["allow_http"] = True
    return {"client_options": client,
            "retry_config": {"max_retries": RETRIES,
                             "retry_timeout": timedelta(seconds=RETRY_TIMEOUT)}}


def check_endpoint(url: str) -> str:
    """An endpoint URL fit to use and to log: http(s), a host, no credentials in it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"endpoint {safe_url(url)!r} is not an http(s) URL")
    if parts.username or parts.password:
        raise ConfigError("the endpoint URL carries credentials: give them in the environment "
                          "or a profile, never in a URL (it would be logged)")
    return url.rstrip("/")


def safe_url(url: str) -> str:
    """A URL fit for a message: any user:password@ part removed."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        return parts._replace(netloc=parts.hostname or "").geturl()
    return url


class ObjectStoreOrigin:
    """What every object store shares: a bucket URL, an endpoint, a listing (each store's
    own), and conditional ranged GETs (``get``; obstore where the store's client is used)."""

    content_ids = False  # a version id names a listing: nothing is read to snapshot
    url: BucketUrl
    endpoint: str | None
    where: str            # "bucket 'b' at http://...": for messages, never a secret

    @property
    def source(self) -> str:
        return str(self.url)

    def check(self) -> None:
        """Can this bucket be listed with these credentials? ConfigError if not."""

    def versioned(self) -> bool:
        """Whether listings pin a version (or generation) besides the ETag."""
        return False

    def list(self, versions: bool) -> Iterator[ObjectInfo]:
        raise NotImplementedError

    def _reader(self) -> obstore.store.ObjectStore:
        raise NotImplementedError

    def _get_options(self, obj: ObjectInfo, start: int, end: int) -> dict[str, Any]:
        opts: dict[str, Any] = {"range": (start, end), "if_match": obj.etag}
        if obj.version_id is not None:
            opts["version"] = obj.version_id
        return opts

    async def get(self, obj: ObjectInfo, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the object as listed, or VersionGone: the GET is conditional
        (If-Match its ETag, and its version where known), so an object overwritten or
        deleted since the listing is never read."""
        import obstore
        from obstore.exceptions import (
            BaseError,
            NotFoundError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        try:
            result = await obstore.get_async(self._reader(), obj.key,  # type: ignore[arg-type]
                                             options=self._get_options(obj, start, end))  # type: ignore[arg-type]
            data = memoryview(await result.bytes_async())
        except (PreconditionError, NotFoundError):
            raise gone(obj) from None
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            log.warning("reading %r from %s: %s", obj.key, self.where, exc)
            raise UpstreamUnavailable(f"{self.where} refused a read", self.where,
                                      "access denied") from None
        except BaseError as exc:
            log.warning("reading %r from %s: %s", obj.key, self.where, exc)
            raise UpstreamUnavailable(f"{self.where} did not answer a read", self.where,
                                      failure_kind(str(exc))) from None
        return self.checked_length(data, start, end)

    def checked_length(self, data: memoryview, start: int, end: int) -> memoryview:
        if len(data) != end - start:  # a store that ignored the range: never misplace bytes
            raise UpstreamUnavailable(f"{self.where} answered {len(data)} bytes for a range of "
                                      f"{end - start}", self.where, "bad answer")
        return data


def gone(obj: ObjectInfo) -> VersionGone:
    return VersionGone(f"{obj.key!r} changed or was deleted in the bucket since its "
                       "snapshot: use a newer snapshot")


def failure_kind(text: str) -> str:
    low = text.lower()
    for needle, kind in (("refused", "connection refused"), ("timed out", "timed out"),
                         ("timeout", "timed out"), ("reset", "connection reset"),
                         ("dns", "name not resolved"), ("connect", "cannot connect"),
                         ("status code: 5", "upstream error")):
        if needle in low:
            return kind
    return "unreachable"


def open_store(url: BucketUrl, endpoint: str | None) -> ObjectStoreOrigin:
    """The origin for ``url``'s store (its client imported only now)."""
    if url.scheme == "gs":
        from spokefs.origin.gcs import GCSOrigin

        return GCSOrigin(url, endpoint)
    if url.scheme == "az":
        from spokefs.origin.azure import AzureOrigin

        return AzureOrigin(url, endpoint)
    from spokefs.origin.s3 import S3Origin

    return S3Origin(url, endpoint)
