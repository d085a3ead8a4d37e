"""A Google Cloud Storage bucket as an origin (``gs://bucket/prefix``): listing and ranged
reads pinned to each object's generation, both through GCS's JSON API.

Why not obstore here, as for S3: object_store's GCS client speaks the XML API (``GET
/bucket/key``, ``?list-type=2`` listings), and no emulator to be had from PyPI serves it
(fake-gcs-server answers 404 to an object path with an encoded ``/``; gcp-storage-emulator
sends no ETag or Last-Modified, which object_store requires), so that path could not be
tested. The JSON API is what GCS and both emulators serve alike, and it is two requests:

- a listing, ``GET /storage/v1/b/BUCKET/o?prefix=P`` (1,000 objects a page), with names
  exactly as stored (a folder marker ``a/`` stays a marker) and each object's generation;
- a read, ``GET /download/storage/v1/b/BUCKET/o/KEY?alt=media&generation=G`` with a Range:
  a generation names one immutable content, so an object overwritten or deleted since the
  listing answers 404 (kept by a bucket with versioning: still the listed bytes), never other
  bytes. A store that reports another generation (``x-goog-generation``) is refused too.

The endpoint: ``--endpoint-url``, else ``STORAGE_EMULATOR_HOST`` (what Google's own clients
read), else ``https://storage.googleapis.com``. Against an emulator requests carry no token;
against GCS the token comes from google-auth's application default credentials (a service
account file in ``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default``,
workload identity, the metadata server), refreshed as it expires (the ``gcs`` extra).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from urllib.parse import quote

import aiohttp
import urllib3

from spokefs.errors import ConfigError, UpstreamUnavailable
from spokefs.origin.base import (
    CONNECT_TIMEOUT,
    REQUEST_TIMEOUT,
    BucketUrl,
    ObjectInfo,
    ObjectStoreOrigin,
    check_endpoint,
    gone,
)

log = logging.getLogger(__name__)

GCS = "https://storage.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
PAGE = 1000


def resolve_endpoint(endpoint: str | None) -> tuple[str, bool]:
    """(the endpoint, whether it is an emulator: no token sent)."""
    url = endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    if url is None:
        return GCS, False
    if "://" not in url:  # STORAGE_EMULATOR_HOST is often host:port
        url = f"http://{url}"
    url = check_endpoint(url)
    return url, url != GCS


class GCSOrigin(ObjectStoreOrigin):
    def __init__(self, url: BucketUrl, endpoint: str | None = None) -> None:
        self.url = url
        self.endpoint, self.emulator = resolve_endpoint(endpoint)
        self.where = (f"bucket {url.bucket!r}" if self.endpoint == GCS
                      else f"bucket {url.bucket!r} at {self.endpoint}")
        self._credentials: Any = None
        self._lock = threading.Lock()  # one token refresh at a time
        if not self.emulator:
            try:
                import google.auth
                from google.auth.exceptions import DefaultCredentialsError
            except ImportError:
                raise ConfigError("serving a gs:// bucket needs google-auth: pip install "
                                  "'spokefs[gcs]'") from None
            try:
                self._credentials, _ = google.auth.default(scopes=[SCOPE])
            except DefaultCredentialsError:
                raise ConfigError(f"no Google credentials found for {self.where}: set "
                                  "GOOGLE_APPLICATION_CREDENTIALS to a service account file, "
                                  "run gcloud auth application-default login, or run with "
                                  "a workload identity") from None
        self._pool = urllib3.PoolManager(timeout=urllib3.Timeout(
            connect=CONNECT_TIMEOUT, read=REQUEST_TIMEOUT), retries=urllib3.Retry(
            3, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)))
        self._session: aiohttp.ClientSession | None = None

    # -- credentials ---------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        """An Authorization header (none for an emulator). Blocking when a token is
        refreshed: called from a thread."""
        if self._credentials is None:
            return {}
        with self._lock:
            if not self._credentials.valid:
                import google.auth.transport.urllib3

                self._credentials.refresh(google.auth.transport.urllib3.Request(self._pool))
            return {"Authorization": f"Bearer {self._credentials.token}"}

    # -- checks and listing (blocking: call from a thread) -------------------------------
    def _get_json(self, path: str, fields: dict[str, str]) -> dict[str, Any]:
        try:
            r = self._pool.request("GET", f"{self.endpoint}{path}", fields=fields,
                                   headers=self._headers())
        except urllib3.exceptions.HTTPError as exc:
            log.warning("asking %s: %s", self.where, exc)
            raise ConfigError(f"cannot reach {self.where}: {type(exc).__name__}") from None
        if r.status == 404:
            raise ConfigError(f"{self.where} does not exist")
        if r.status in (401, 403):
            raise ConfigError(f"{self.where} refused the credentials ({r.status}): check "
                              "GOOGLE_APPLICATION_CREDENTIALS or the workload identity, and "
                              "that it may list the bucket (storage.objects.list)")
        if r.status != 200:
            raise ConfigError(f"{self.where} answered {r.status}")
        try:
            return json.loads(r.data)
        except ValueError:
            raise ConfigError(f"{self.where} answered something that is not JSON") from None

    def check(self) -> None:
        self._get_json(f"/storage/v1/b/{quote(self.url.bucket, safe='')}", {})

    def versioned(self) -> bool:
        return True  # every GCS object has a generation: listings always pin it

    def list(self, versions: bool = True) -> Iterator[ObjectInfo]:
        fields = {"prefix": self.url.prefix, "maxResults": str(PAGE)}
        path = f"/storage/v1/b/{quote(self.url.bucket, safe='')}/o"
        while True:
            page = self._get_json(path, fields)
            for o in page.get("items", []):
                mtime = datetime.fromisoformat(o["updated"].replace("Z", "+00:00"))
                yield ObjectInfo(o["name"], int(o["size"]), str(o.get("etag", "")),
                                 str(o["generation"]), int(mtime.timestamp() * 1e9))
            token = page.get("nextPageToken")
            if not token:
                return
            fields["pageToken"] = token

    # -- reads (on the event loop) -------------------------------------------------------
    async def get(self, obj: ObjectInfo, start: int, end: int) -> memoryview:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=REQUEST_TIMEOUT, connect=CONNECT_TIMEOUT))
        headers = (await asyncio.to_thread(self._headers)) if self._credentials else {}
        headers["Range"] = f"bytes={start}-{end - 1}"
        url = (f"{self.endpoint}/download/storage/v1/b/{quote(self.url.bucket, safe='')}/o/"
               f"{quote(obj.key, safe='')}")
        params = {"alt": "media", "generation": obj.version_id or ""}
        try:
            async with self._session.get(url, params=params, headers=headers) as r:
                if r.status in (404, 412):
                    raise gone(obj)
                if r.status in (401, 403):
                    raise UpstreamUnavailable(f"{self.where} refused a read", self.where,
                                              "access denied")
                if r.status not in (200, 206):
                    raise UpstreamUnavailable(f"{self.where} answered {r.status} to a read",
                                              self.where, "upstream error")
                served = r.headers.get("x-goog-generation")
                if served is not None and served != obj.version_id:
                    raise gone(obj)
                data = memoryview(await r.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("reading %r from %s: %s", obj.key, self.where, exc)
            kind = "timed out" if isinstance(exc, TimeoutError) else "cannot connect"
            raise UpstreamUnavailable(f"{self.where} did not answer a read", self.where,
                                      kind) from None
        if r.status == 200 and (start, end) != (0, len(data)):  # the range was ignored
            data = data[start:end]
        return self.checked_length(data, start, end)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
