"""Async metadata client for the wire protocol (aiohttp): dataset info, manifests, control
requests, and a replica worker's requests to its primary. Block data goes through
``spokefs.wire.http1.DataClient``, which receives bodies in place.

Kept-alive connections in a pool. Errors are mapped at this boundary, by
``spokefs.wire.errors``: ``Transient`` (connection refused or reset, timeouts, 5xx) may be
retried; a ``SpokeError`` (404, 410, 416, 400; an untrusted certificate) is final.

Every body is read against a bound, checked on the declared length first and then as bytes
arrive, so an upstream (or anything posing as one) cannot grow this process's memory without
end: JSON answers ``max_json_bytes`` (16 MiB; a locate answer for the largest batch is ~2 MB),
manifests ``MAX_MANIFEST_BLOB`` (1 GiB as sent; ``Manifest.decode`` bounds the decompressed
JSON too), a range read what it asked for. Past the bound: ``BadUpstream``, final (asking
again gets the same answer). ``open`` is the exception: a replica passes its clients'
requests to its own primary through it and streams the answer on, of any size.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import AsyncIterable

import aiohttp

from spokefs.errors import BadUpstream, SpokeError
from spokefs.manifest import MAX_MANIFEST_BLOB, MAX_MANIFEST_BYTES, Manifest
from spokefs.wire.auth import FROM_ENV, bearer, client_token
from spokefs.wire.errors import error_for_transport
from spokefs.wire.errors import raise_for_status as raise_for_status
from spokefs.wire.tls import client_context
from spokefs.wire.unixpath import unix_address

MAX_JSON_BYTES = 16 << 20
# What a failed exchange raises below the protocol (SpokeErrors pass through untouched).
_TRANSPORT = (TimeoutError, aiohttp.ClientError, OSError)
_ERROR_BODY_BYTES = 1 << 20  # room for an error answer to a read of a few bytes


class UpstreamClient:
    """``unix_socket``: reach the upstream through that socket (a spoke's replica workers
    talk to its primary so); ``base_url`` then only names it. ``answers_final``: an error
    answer, 5xx included, is the upstream's last word (it retried upstream itself)."""

    def __init__(self, base_url: str, max_connections: int = 128,
                 request_timeout: float = 60.0, unix_socket: str | None = None,
                 answers_final: bool = False, max_json_bytes: int = MAX_JSON_BYTES,
                 max_manifest_bytes: int = MAX_MANIFEST_BLOB,
                 max_manifest_json: int = MAX_MANIFEST_BYTES,
                 token: str | object | None = FROM_ENV) -> None:
        self.base_url = base_url.rstrip("/")
        tok = client_token() if token is FROM_ENV else token
        self._headers = bearer(tok)  # type: ignore[arg-type]  # with every request; never logged
        # Bounds on what an answer may hold (see the module docstring).
        self.max_json_bytes = max_json_bytes
        self.max_manifest_bytes = max_manifest_bytes   # as sent (gzip'd)
        self.max_manifest_json = max_manifest_json     # decompressed, when decoded here
        # Every answer is final, 5xx included (a spoke's primary worker has already retried
        # its own upstream): only a failed connection is worth retrying.
        self.answers_final = answers_final
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.unix_socket = unix_socket
        self._session: aiohttp.ClientSession | None = None
        # time.monotonic() of the last bytes from the upstream: tells a slow link (bytes keep
        # coming) from a dead one (nothing for the deadline).
        self.last_received = time.monotonic()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily inside the running loop
            connector: aiohttp.BaseConnector
            if self.unix_socket is not None:
                connector = aiohttp.UnixConnector(unix_address(self.unix_socket),
                                                  limit=self.max_connections,
                                                  keepalive_timeout=120)
            else:
                connector = aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=self.max_connections,
                    keepalive_timeout=120, ttl_dns_cache=300,
                    ssl=client_context() if self.base_url.startswith("https:") else False)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                            sock_read=self.request_timeout)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                                  auto_decompress=False,
                                                  headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str, headers: dict[str, str] | None = None,
                   limit: int | None = None) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of GET ``path``. A body of more than ``limit`` bytes
        (``max_json_bytes`` if None) raises BadUpstream."""
        url = f"{self.base_url}{path}"
        limit = self.max_json_bytes if limit is None else limit
        try:
            async with self.session.get(url, headers=headers) as resp:
                self.last_received = time.monotonic()
                body = await self._body(resp, limit, f"GET {path}")
                return resp.status, dict(resp.headers), body
        except SpokeError:
            raise
        except _TRANSPORT as exc:
            raise error_for_transport(exc, self.base_url) from exc

    async def _body(self, resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
        """The whole body, or BadUpstream as soon as it is known to pass ``limit`` (from its
        Content-Length, else from the bytes counted as they arrive); leaving the response
        unread closes its connection."""
        declared = resp.content_length
        if declared is not None and declared > limit:
            raise _too_large(what, resp.status, f"{declared}", limit)
        chunks = []
        got = 0
        async for chunk in resp.content.iter_any():
            self.last_received = time.monotonic()  # the upstream is alive, if slow
            got += len(chunk)
            if got > limit:
                raise _too_large(what, resp.status, f"more than {got - 1}", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _check(self, status: int, body: bytes, what: str) -> None:
        if status >= 400:
            raise_for_status(status, body, what, final=self.answers_final)

    async def forward(self, method: str, path: str, headers: dict[str, str], body: bytes,
                      limit: int | None = None) -> tuple[int, dict[str, str], bytes]:
        """Any request, answered as is (status, headers, body): for a proxy. A body past
        ``limit`` bytes (``max_json_bytes`` if None) raises BadUpstream."""
        resp = await self.open(method, path, headers, body)
        try:
            data = await self._body(resp, self.max_json_bytes if limit is None else limit,
                                    f"{method} {path}")
        except SpokeError:
            raise
        except _TRANSPORT as exc:
            raise error_for_transport(exc, self.base_url) from exc
        finally:
            resp.release()
        return resp.status, dict(resp.headers), data

    async def open(self, method: str, path: str, headers: dict[str, str],
                   body: bytes | AsyncIterable[bytes] | aiohttp.StreamReader
                   ) -> aiohttp.ClientResponse:
        """Any request, up to its answer's head: the caller reads the body as it comes
        (``resp.content``), of any size, and releases the response. ``body``: bytes, or
        pieces streamed as they come (sent once: no retry can send them again)."""
        try:
            resp = await self.session.request(method, f"{self.base_url}{path}",
                                              headers=headers, data=body or None)
        except _TRANSPORT as exc:
            raise error_for_transport(exc, self.base_url) from exc
        self.last_received = time.monotonic()
        return resp

    async def get_json(self, path: str) -> dict:
        status, _, body = await self._get(path)
        self._check(status, body, path)
        return json.loads(body)

    async def post_json(self, path: str, doc: object,
                        headers: dict[str, str] | None = None) -> dict:
        try:
            async with self.session.post(f"{self.base_url}{path}", json=doc,
                                         headers=headers) as resp:
                self.last_received = time.monotonic()
                body = await self._body(resp, self.max_json_bytes, f"POST {path}")
                status = resp.status
        except SpokeError:
            raise
        except _TRANSPORT as exc:
            raise error_for_transport(exc, self.base_url,
                                      str(exc) or type(exc).__name__) from exc
        self._check(status, body, path)
        return json.loads(body)

    async def manifest_blob(self, dataset: str, snap: str) -> bytes:
        path = f"/v1/datasets/{dataset}/snapshots/{snap}/manifest"
        status, headers, body = await self._get(path, limit=self.max_manifest_bytes)
        self._check(status, body, path)
        if headers.get("Content-Encoding", "") != "gzip":
            body = gzip.compress(body)
        return body

    async def manifest(self, dataset: str, snap: str) -> Manifest:
        blob = await self.manifest_blob(dataset, snap)
        return await asyncio.to_thread(Manifest.decode, blob, self.max_manifest_json)


def _too_large(what: str, status: int, size: str, limit: int) -> BadUpstream:
    # No upstream address in the message: it may travel on to a client in an answer.
    return BadUpstream(f"the upstream answered {what} with {status} and a body of {size} "
                       f"bytes, more than the {limit} read from it; refused")
