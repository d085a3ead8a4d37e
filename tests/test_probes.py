"""The probes an orchestrator asks: ``GET /healthz`` (the event loop answers in time) and
``GET /readyz`` (the upstream or the cache is usable; a hub's datasets), on real hub and
spoke processes, with ``--auth`` on and no token, on every worker of ``--workers 2``.

The loop is held for real: the process is stopped (SIGSTOP), as a loop stuck in a blocking
call would be; no test-only hook in the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.spoke.service import SpokeBackend

ADMIN = "admin-" + "a" * 32
PROBES = ("/healthz", "/readyz")
pool = urllib3.PoolManager(retries=False)


def probe(base: str, path: str, timeout: float = 10.0) -> tuple[int, dict[str, object]]:
    """A probe on a fresh connection (on a spoke of many workers: any of them), no token."""
    r = pool.request("GET", base + path, headers={"Connection": "close"},
                     timeout=urllib3.Timeout(connect=timeout, read=timeout))
    return r.status, json.loads(r.data)


def wait_for(base: str, path: str, status: int, timeout: float = 30.0) -> dict[str, object]:
    end = time.monotonic() + timeout
    while True:
        got, doc = probe(base, path)
        if got == status:
            return doc
        assert time.monotonic() < end, f"{path} still {got} {doc} after {timeout}s"
        time.sleep(0.1)


def assert_no_data(doc: dict[str, object], *secrets: str) -> None:
    """Only ok and a generic reason: no dataset, path, address or figure."""
    assert set(doc) <= {"ok", "reason"}, doc
    text = json.dumps(doc)
    assert not any(ch.isdigit() for ch in text), doc
    for s in secrets:
        assert s not in text, (s, doc)


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"admin admin {ADMIN}\n")
    return path


def test_hub_probes_answer_without_a_token_and_readyz_follows_its_datasets(
        tmp_path: Path, tokens: Path) -> None:
    ds = make_dataset(tmp_path / "ds", n_small=2, big_sizes=())
    with hub(ds, tmp_path / "state", "--auth", str(tokens)) as h:
        assert pool.request("GET", f"{h.url}/v1/status").status == 401  # auth is on
        for path in PROBES:
            status, doc = probe(h.url, path)
            assert (status, doc) == (200, {"ok": True})
            head = pool.request("HEAD", h.url + path)
            assert (head.status, head.data) == (200, b"")
        # The dataset's folder gone: not ready, saying so without naming it; back: ready.
        ds.rename(tmp_path / "moved")
        doc = wait_for(h.url, "/readyz", 503)
        assert doc["ok"] is False and doc["reason"]
        assert_no_data(doc, "ds", str(tmp_path))
        assert probe(h.url, "/healthz")[0] == 200  # alive all the same
        (tmp_path / "moved").rename(ds)
        wait_for(h.url, "/readyz", 200)


def test_healthz_is_503_or_unanswered_while_the_loop_is_held(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", n_small=2, big_sizes=())
    with ServerProcess("hub", "serve", str(ds), "--port", "0", "--state-dir",
                       str(tmp_path / "state"),
                       env={"SPOKEFS_HEALTHZ_MAX_LAG": "0.5"}) as h:
        assert probe(h.url, "/healthz") == (200, {"ok": True})
        with socket.create_connection(("127.0.0.1", h.port), timeout=10) as sock:
            os.kill(h.pid, signal.SIGSTOP)  # the loop holds: nothing of the process runs
            try:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                sock.settimeout(1.5)
                with pytest.raises(TimeoutError):
                    sock.recv(1)  # a held loop does not answer
            finally:
                os.kill(h.pid, signal.SIGCONT)
            sock.settimeout(10)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        # Answered once the loop runs again, by a loop that was late by the whole hold.
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        doc = json.loads(body)
        assert doc["ok"] is False and "lag" in str(doc["reason"])
        assert_no_data(doc)
        wait_for(h.url, "/healthz", 200, timeout=15)  # a stall that ended passes


def _workers(supervisor: int) -> dict[str, int]:
    """The supervisor's worker processes by role (``spoke.workers``)."""
    out = {}
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    for pid in map(int, children):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--role" in args:
            out[args[args.index(b"--role") + 1].decode()] = pid
    return out


def test_spoke_probes_without_a_token_on_every_worker(tmp_path: Path, tokens: Path) -> None:
    ds = make_dataset(tmp_path / "ds", n_small=2, big_sizes=())
    with hub(ds, tmp_path / "state") as h, \
            spoke(h.url, tmp_path / "cache", "64MiB", "--workers", "2",
                  "--auth", str(tokens)) as s:
        assert pool.request("GET", f"{s.url}/v1/status").status == 401
        for _ in range(8):  # fresh connections: both workers answer some
            for path in PROBES:
                assert probe(s.url, path) == (200, {"ok": True})
        # The primary held: the replica still answers /healthz with its own loop.
        primary = _workers(s.pid)["primary"]
        os.kill(primary, signal.SIGSTOP)
        try:
            answered = 0
            for _ in range(16):
                try:
                    status, doc = probe(s.url, "/healthz", timeout=1.0)
                except urllib3.exceptions.TimeoutError:
                    continue  # landed on the held primary
                assert (status, doc) == (200, {"ok": True})
                answered += 1
            assert answered > 0
        finally:
            os.kill(primary, signal.SIGCONT)
        wait_for(s.url, "/healthz", 200)


@pytest.mark.skipif(not hasattr(SpokeBackend, "ready"),
                    reason="the spoke's readiness check (SpokeBackend.ready) is not in yet")
@pytest.mark.parametrize("workers", ["1", "2"])
def test_spoke_readyz_needs_the_upstream_or_something_cached(tmp_path: Path, tokens: Path,
                                                             workers: str) -> None:
    """The rule (docs/operations.md): ready while the cache is open and either the upstream
    answered lately or the cache holds blocks to serve."""
    ds = make_dataset(tmp_path / "ds", n_small=2, big_sizes=())
    h = hub(ds, tmp_path / "state").start()
    try:
        with spoke(h.url, tmp_path / "cache", "64MiB", "--workers", workers,
                   "--deadline", "1s", "--auth", str(tokens)) as s:
            assert probe(s.url, "/readyz") == (200, {"ok": True})
            h.stop()  # the upstream gone, nothing cached: not ready
            doc = wait_for(s.url, "/readyz", 503)
            assert_no_data(doc, h.url, h.hostport)
            assert probe(s.url, "/healthz")[0] == 200  # alive all the same
    finally:
        h.stop()
    # Something cached: ready without the upstream.
    with hub(ds, tmp_path / "state") as h2, \
            spoke(h2.url, tmp_path / "cache2", "64MiB", "--workers", workers,
                  "--deadline", "1s") as s2:
        r = pool.request("GET", f"{s2.url}/ds/class0/img0000.jpg")
        assert r.status == 200
        h2.stop()
        assert probe(s2.url, "/readyz") == (200, {"ok": True})
