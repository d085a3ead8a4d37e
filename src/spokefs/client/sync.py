"""A small synchronous client for the wire protocol (urllib3, pooled keep-alive connections).

Used by ``spokefs.open``, the fsspec filesystem and the CLI. Errors are mapped by
``spokefs.wire.errors``: connection failures are retried, then become UpstreamUnavailable
(of their ``Failure`` kind) after ``deadline``; an untrusted certificate is final at once;
an error answer becomes the SpokeError the server sent (NotFound is a FileNotFoundError,
Unauthorized and Forbidden PermissionErrors: ``spokefs.errors``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, BinaryIO

import urllib3

from spokefs.errors import Transient, UpstreamUnavailable
from spokefs.manifest import Manifest
from spokefs.retry import UPSTREAM
from spokefs.wire.auth import FROM_ENV, bearer, client_token
from spokefs.wire.errors import error_for_status, error_for_transport
from spokefs.wire.headers import H_SNAPSHOT
from spokefs.wire.tls import client_context

# Bytes a file body (an upload) is read and sent in: urllib3's default, 16 KiB, made a
# checkpoint's upload two system calls and a Python call per 16 KiB.
SEND_PIECE = 1 << 20
_pools: dict[tuple[int, str], urllib3.PoolManager] = {}
_pools_lock = threading.Lock()


def _pool(base: str) -> urllib3.PoolManager:
    # Keyed by process: a DataLoader worker forked from a process that had connections open
    # must not share their sockets with its parent.
    key = (os.getpid(), base)
    with _pools_lock:
        pm = _pools.get(key)
        if pm is None:
            tls = client_context() if base.startswith("https:") else None
            pm = _pools[key] = urllib3.PoolManager(num_pools=4, maxsize=32, block=False,
                                                   retries=False, ssl_context=tls,
                                                   blocksize=SEND_PIECE)
            # retries=False: the loops below retry, by spokefs.retry's policy (urllib3's
            # Retry counts tries; it has no deadline, would retry an untrusted certificate,
            # and cannot resume a body cut short).
        return pm


class Client:
    def __init__(self, base: str, deadline: float = 30.0, timeout: float = 60.0,
                 token: str | object | None = FROM_ENV) -> None:
        self.base = base.rstrip("/")
        self.deadline = deadline
        self.timeout = urllib3.Timeout(connect=10, read=timeout)
        tok = client_token() if token is FROM_ENV else token
        self._auth = bearer(tok)  # type: ignore[arg-type]  # with every request; never logged

    def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | BinaryIO | None = None, decode: bool = True, stream: bool = False,
                once: bool = False) -> urllib3.BaseHTTPResponse:
        """One request, retried on connection failures until the deadline; an error status
        raises its SpokeError. ``stream``: the body is left to read (then release_conn()).
        ``once``: a failed exchange raises its Transient at once (a body read as it is sent
        cannot be sent again: the caller resumes it)."""
        policy, t0 = UPSTREAM.within(self.deadline), time.monotonic()
        for delay in policy.delays():
            try:
                resp = _pool(self.base).request(method, f"{self.base}{path}",
                                                headers={**self._auth, **(headers or {})},
                                                body=body, timeout=self.timeout,
                                                decode_content=decode,
                                                preload_content=not stream)
            except urllib3.exceptions.HTTPError as exc:
                err = self._failed(exc)
                if once:
                    raise err from exc
                pause = policy.pause(delay, time.monotonic() - t0)
                if pause is None:
                    raise UpstreamUnavailable(f"{self.base} unreachable for {self.deadline:g}s: "
                                              f"{err}", self.base, str(err), err.kind) from exc
                time.sleep(pause)  # one last try at the deadline
                continue
            if resp.status >= 400:
                # The server's own answer: it retried its upstream itself, so 5xx are final.
                raise error_for_status(resp.status, resp.data,
                                       f"{method} {path}: HTTP {resp.status}", final=True)
            return resp
        raise AssertionError("unreachable")

    def _failed(self, exc: urllib3.exceptions.HTTPError) -> Transient:
        """A failed exchange: worth retrying (returned), else final (raised)."""
        err = error_for_transport(exc, self.base, str(exc.__cause__ or exc))
        if not isinstance(err, Transient):
            raise err from exc  # an untrusted certificate: asking again gets the same
        return err

    def get_json(self, path: str) -> Any:
        return json.loads(self.request("GET", path).data)

    def post_json(self, path: str, doc: object) -> Any:
        resp = self.request("POST", path, {"Content-Type": "application/json"},
                            json.dumps(doc).encode())
        return json.loads(resp.data)

    def resolve(self, dataset: str, snap: str) -> str:
        return str(self.get_json(f"/v1/datasets/{dataset}/snapshots/{snap}")["id"])

    def manifest(self, dataset: str, snap: str) -> Manifest:
        resp = self.request("GET", f"/v1/datasets/{dataset}/snapshots/{snap}/manifest",
                            decode=False)
        return Manifest.decode(resp.data)

    def entry(self, dataset: str, snap: str, path: str) -> dict[str, Any]:
        return dict(self.get_json(f"/v1/datasets/{dataset}/snapshots/{snap}/entries/{path}"))

    def read(self, dataset: str, version: str, start: int, end: int,
             snapshot: str | None = None) -> bytes:
        """Bytes [start, end) of a file version (end may pass EOF; the answer is clamped).

        A body cut short (the connection broke, or the server failed after it had begun to
        answer, e.g. a later block's version is gone) is resumed from where it broke, so the
        caller gets the rest or the server's own error for that part (VersionGone,
        UpstreamUnavailable), not a retry of the whole range until the deadline."""
        path = f"/v1/datasets/{dataset}/objects/{version}"
        # The snapshot read from: a spoke keeps its files while readers name it.
        named = {H_SNAPSHOT: snapshot} if snapshot else {}
        out = bytearray()
        policy, t0 = UPSTREAM.within(self.deadline), time.monotonic()
        for delay in policy.delays():
            had = len(out)
            resp = self.request("GET", path, {"Range": f"bytes={start + had}-{end - 1}",
                                              **named}, stream=True)
            try:
                for chunk in resp.stream(1 << 20):
                    out += chunk
                return bytes(out)
            except urllib3.exceptions.HTTPError as exc:
                err = self._failed(exc)
            finally:
                resp.release_conn()
            if start + len(out) >= end:
                return bytes(out)
            if len(out) == had:  # no progress: back off, and not past the deadline
                pause = policy.pause(delay, time.monotonic() - t0)
                if pause is None:
                    raise UpstreamUnavailable(f"{self.base} cut every answer short for "
                                              f"{self.deadline:g}s: {err}", self.base, str(err),
                                              err.kind)
                time.sleep(pause)
        raise AssertionError("unreachable")
