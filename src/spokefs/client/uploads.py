"""Writing files into a writable dataset of a hub: resumable uploads, then one commit that
publishes them together as a new snapshot (the hub's side: ``spokefs.hub.uploads``).

    up = Uploader("http://hub:8470", "ckpt")           # token: SPOKEFS_TOKEN or token=
    up.put("step-100/rank0.pt", Path("/local/rank0.pt"))
    up.put("step-100/.metadata", Path("/local/.metadata"))
    up.commit(prefix="step-100/")                        # readers see all of step-100 or none

``put`` digests the file first (the version it declares, over the dataset's block size),
then sends it from the bytes the hub already holds: a put that broke off, or one run again
after a crash, sends only the rest. A file changed while it was sent is refused by the hub
(422: its bytes are not the version declared) and sent again from its new content, up to
``tries`` times. On a spoke's own host (``handoff``: its socket, ``find_handoff``) ``put``
gives the spoke the file's descriptor instead of sending its bytes (``client.handoff``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from spokefs import integrity
from spokefs.client import handoff as same_host
from spokefs.client.sync import Client
from spokefs.errors import (
    Conflict,
    DigestMismatch,
    Forbidden,
    NoSpace,
    NotFound,
    SpokeError,
    Transient,
    Unauthorized,
    UpstreamUnavailable,
)
from spokefs.retry import UPSTREAM
from spokefs.wire.auth import FROM_ENV, client_token
from spokefs.wire.headers import H_OFFSET, H_SIZE, H_VERSION

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sent:
    """One ``put``: the path, its size and version, and the bytes this call sent (less than
    the size when it resumed)."""

    path: str
    size: int
    version: str
    sent: int
    handed: bool = False  # given to the spoke by descriptor, not sent over HTTP


def file_version(f: BinaryIO, block_size: int) -> tuple[int, str]:
    """``f``'s size and version id (read from its start)."""
    f.seek(0)
    size, digests = integrity.stream_digests(f, block_size)
    return size, integrity.version_id(size, block_size, digests)


class Uploader:
    def __init__(self, hub: str, dataset: str, token: str | object | None = FROM_ENV,
                 deadline: float = 60.0, timeout: float = 300.0,
                 handoff: Path | None = None) -> None:
        self.token = client_token() if token is FROM_ENV else token
        self.client = Client(hub, deadline=deadline, timeout=timeout, token=self.token)
        self.dataset = dataset
        # The spoke's handoff socket where it runs on this host; None: puts go over HTTP.
        self.handoff = handoff
        self._block_size: int | None = None

    def find_handoff(self, spoke_cache: Path | None = None) -> Path | None:
        """Hand files to the spoke by descriptor from now on if it runs on this host
        (``client.handoff.find_socket``); the socket, or None."""
        self.handoff = same_host.find_socket(self.client, spoke_cache)
        return self.handoff

    @property
    def block_size(self) -> int:
        if self._block_size is None:
            self.check_writable()
        assert self._block_size is not None
        return self._block_size

    def check_writable(self) -> None:
        """Forbidden unless the server says the dataset takes writes (asked once)."""
        if self._block_size is not None:
            return
        doc = self.client.get_json(f"/v1/datasets/{quote(self.dataset)}")
        if doc.get("writable") is not True:
            raise Forbidden(f"dataset {self.dataset!r} is read-only: a writable dataset is "
                            "declared so at its hub (docs/checkpoints.md)")
        self._block_size = int(doc["block_size"])

    def _url(self, path: str) -> str:
        return f"/v1/datasets/{quote(self.dataset)}/uploads/{quote(path)}"

    def state(self, path: str) -> dict[str, Any] | None:
        """What the hub holds of an upload of ``path`` (received, whole), or None."""
        try:
            return dict(self.client.get_json(self._url(path)))
        except NotFound:
            return None

    def listing(self) -> list[dict[str, Any]]:
        return list(self.client.get_json(f"/v1/datasets/{quote(self.dataset)}/uploads")
                    ["uploads"])

    def discard(self, path: str) -> None:
        self.client.request("DELETE", self._url(path))

    def put(self, path: str, source: Path, tries: int = 3,
            progress: Callable[[int], object] | None = None) -> Sent:
        """``source``'s bytes as ``path``, whole and checked at the hub (not yet published:
        ``commit``): handed to the spoke by descriptor where it is on this host, else (or
        where it cannot take it) sent. ``progress``: called with the count of each piece
        sent."""
        if self.handoff is not None and (handed := self._hand_off(path, source)) is not None:
            return handed
        with open(source, "rb") as f:
            for attempt in range(tries):
                size, version = file_version(f, self.block_size)
                try:
                    return self._send(path, f, size, version, progress)
                except DigestMismatch:
                    if attempt == tries - 1:
                        raise
        raise AssertionError("unreachable")

    def _hand_off(self, path: str, source: Path) -> Sent | None:
        """``source`` held whole by the spoke by descriptor; None to send it over HTTP (no
        spoke on the socket, or one that would not read it: nothing is held of it then)."""
        assert self.handoff is not None
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                doc = same_host.hand_off(self.handoff, self.token if isinstance(self.token, str)
                                         else None, self.dataset, path, f.fileno(), size)
            except same_host.HandoffUnavailable as exc:
                log.info("%s goes over HTTP: %s", path, exc)
                return None
            except (Unauthorized, Forbidden, NoSpace, NotFound):
                raise  # what the HTTP route would answer too
            except (SpokeError, Transient) as exc:
                # A descriptor the spoke would not read, a file changed, a check that timed
                # out: HTTP, with its own retries, depends on none of that.
                log.warning("the spoke did not take %s by handoff (%s); sending it over HTTP",
                            path, exc)
                return None
        return Sent(path, size, str(doc["version"]), 0, handed=True)

    def _send(self, path: str, f: BinaryIO, size: int, version: str,
              progress: Callable[[int], object] | None) -> Sent:
        """Sent from what the hub holds; a broken exchange asks again what it holds and
        goes on from there, until the client's deadline passes with no progress."""
        policy, t0 = UPSTREAM.within(self.client.deadline), time.monotonic()
        sent = 0
        for delay in policy.delays():
            held = self.state(path)
            offset = 0
            if held is not None and (held["size"], held["version"]) == (size, version):
                offset = int(held["received"])
                if held["whole"]:
                    return Sent(path, size, version, sent)
            f.seek(offset)
            headers = {H_SIZE: str(size), H_VERSION: version, H_OFFSET: str(offset),
                       "Content-Type": "application/octet-stream",
                       "Content-Length": str(size - offset)}
            try:
                # Streamed as it is read; the hub flushes what arrived before it answers.
                resp = self.client.request("PUT", self._url(path), headers,
                                           body=_Window(f, size - offset, progress),
                                           once=True)
            except (Transient, Conflict) as exc:
                # Broken off, or out of step with the hub (an earlier send of this file still
                # being received there): ask again what it holds, and go on from there.
                now = self.state(path)
                if now is not None and int(now["received"]) > offset:
                    sent += int(now["received"]) - offset
                    t0 = time.monotonic()  # progress: the deadline counts from here
                pause = policy.pause(delay, time.monotonic() - t0)
                if pause is None:
                    if isinstance(exc, Conflict):
                        raise
                    raise UpstreamUnavailable(f"{path}: the upload made no progress for "
                                              f"{self.client.deadline:g}s: {exc}",
                                              self.client.base, str(exc), exc.kind) from exc
                time.sleep(pause)
                continue
            doc = resp.json()
            sent += size - offset
            if not doc.get("whole"):
                raise OSError(f"{path}: the hub holds {doc.get('received')} of {size} bytes "
                              "after the whole body was sent")
            return Sent(path, size, version, sent)
        raise AssertionError("unreachable")

    def commit(self, paths: list[str] | None = None, prefix: str | None = None
               ) -> dict[str, Any]:
        """Publish whole uploads (``paths``, or every one under ``prefix``) as one snapshot;
        its document (``id``, ``committed``)."""
        doc: dict[str, Any] = {"paths": paths} if paths is not None else {"prefix": prefix}
        body = json.dumps(doc).encode()
        url = f"/v1/datasets/{quote(self.dataset)}/commit"
        policy, t0 = UPSTREAM.within(self.client.deadline), time.monotonic()
        sending, resent = True, False
        for delay in policy.delays():
            if sending:
                # Sent once per try: a commit resent blindly after its answer was lost would
                # find its uploads gone (404) though it landed. A broken exchange (or, on a
                # resend, a 404 or 409: the first one got there after all) asks what became
                # of it.
                try:
                    resp = self.client.request("POST", url,
                                               {"Content-Type": "application/json"}, body,
                                               once=True)
                    return dict(json.loads(resp.data))
                except Transient as exc:
                    failure: Exception = exc
                except (NotFound, Conflict) as exc:
                    if not resent:
                        raise
                    failure = exc
            try:
                landed = self._landed(paths, prefix)
            except Transient as exc:
                failure, landed = exc, None
            if landed:
                return self._committed(paths, prefix)
            if landed is False and isinstance(failure, NotFound | Conflict):
                raise failure  # the hub's own refusal, its uploads still held
            sending = landed is False  # all still held, none being committed: send again
            resent = resent or sending
            pause = policy.pause(delay, time.monotonic() - t0)
            if pause is None:
                raise UpstreamUnavailable(
                    f"the commit's answer was lost, and whether it landed could not be told "
                    f"for {self.client.deadline:g}s: {failure}", self.client.base,
                    str(failure), getattr(failure, "kind", None)) from failure
            time.sleep(pause)
        raise AssertionError("unreachable")

    def writeback(self) -> dict[str, Any]:
        """The dataset's uploads document: at a spoke, with ``commits`` (not yet published
        at the hub), ``failed``, ``done`` and ``unsafe_bytes`` (``spoke/writeback.py``)."""
        return dict(self.client.get_json(f"/v1/datasets/{quote(self.dataset)}/uploads"))

    def wait_safe(self, prefix: str = "", timeout: float = 3600.0, poll: float = 0.2) -> bool:
        """True once no commit naming a path under ``prefix`` waits at the spoke (each is
        published at the hub); False when ``timeout`` passed first. Conflict when the hub
        refused one (its reason). At a hub, what is committed is safe: True at once."""
        end = time.monotonic() + timeout
        file = prefix.rstrip("/")

        def under(p: str) -> bool:  # ``prefix`` names a folder, or one file
            return p == file or p.startswith(f"{file}/") or not file

        while True:
            doc = self.writeback()
            done = {p for c in doc.get("done", ()) for p in c.get("paths", ())}
            for c in doc.get("failed", ()):
                # A refusal counts unless every path of it was published since.
                if any(under(p) for p in c["paths"]) and not set(c["paths"]) <= done:
                    raise Conflict(f"commit {c['commit']} was refused by the hub: {c['error']}")
            if not any(any(under(p) for p in c["paths"]) for c in doc.get("commits", ())):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(min(poll, max(0.0, end - time.monotonic())))
            poll = min(poll * 1.5, 0.5)

    def _named(self, ups: list[dict[str, Any]], paths: list[str] | None,
               prefix: str | None) -> list[dict[str, Any]]:
        return [u for u in ups
                if (u["path"] in paths if paths is not None else u["path"].startswith(prefix))]

    def _landed(self, paths: list[str] | None, prefix: str | None) -> bool | None:
        """After a commit whose answer was lost: True when none of its uploads is left
        (published: a commit is all or nothing), None while the hub is still committing
        them, False when they are all still held (it never arrived, or failed: resend)."""
        doc = self.writeback()
        named = self._named(doc["uploads"], paths, prefix)
        mine = {u["path"] for u in named}
        if mine and any(mine <= set(c["paths"]) for c in doc.get("commits", ())):
            return True  # a spoke journalled it: the 202 was lost, the commit is durable
        if any(u.get("committing") for u in named):
            return None
        return not named

    def _committed(self, paths: list[str] | None, prefix: str | None) -> dict[str, Any]:
        """The answer a commit that landed would have given, from the latest snapshot (at
        a spoke that journalled it: its journal)."""
        doc = self.writeback()
        for c in doc.get("commits", ()):
            named = {u["path"] for u in self._named(doc["uploads"], paths, prefix)}
            if named and named <= set(c["paths"]):
                return {"dataset": self.dataset, "commit": c["commit"],
                        "committed": sorted(named), "safe": False, "recovered": True}
        latest = self.client.get_json(f"/v1/datasets/{quote(self.dataset)}/snapshots/latest")
        m = self.client.manifest(self.dataset, str(latest["id"]))
        have = set(m.paths)
        chosen = ([p for p in paths if p in have] if paths is not None
                  else [p for p in m.paths if p.startswith(prefix or "")])
        if paths is not None and len(chosen) != len(set(paths)):
            raise Conflict(f"the commit's uploads are gone but {len(set(paths)) - len(chosen)} "
                           "of its paths are not in the latest snapshot: discarded meanwhile?")
        return {"dataset": self.dataset, "committed": chosen, "recovered": True, **latest}


class _Window:
    """The next ``left`` bytes of ``f`` as a readable body (a file changed meanwhile sends
    what it holds; the hub's digest check refuses it)."""

    def __init__(self, f: BinaryIO, left: int,
                 progress: Callable[[int], object] | None = None) -> None:
        self.f, self.left, self.progress = f, left, progress

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.f.read(want) if want else b""
        self.left -= len(data)
        if self.progress is not None and data:
            self.progress(len(data))
        return data


def tree_files(local: Path, prefix: str) -> list[tuple[str, Path]]:
    """Every regular file under ``local`` (a file: itself) as (``prefix/RELATIVE``, its
    path), in path order; symlinks are not followed."""
    if local.is_file():
        return [(prefix.strip("/") or local.name, local)]
    out = []
    for dirpath, dirnames, filenames in os.walk(local):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath, name)
            if full.is_file() and not full.is_symlink():
                rel = full.relative_to(local).as_posix()
                out.append((f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel, full))
    return out


def put_tree(up: Uploader, local: Path, prefix: str,
             progress: Callable[[int], object] | None = None) -> list[Sent]:
    """Every regular file under ``local`` put as ``prefix/RELATIVE``, in path order."""
    return [up.put(path, full, progress=progress) for path, full in tree_files(local, prefix)]
