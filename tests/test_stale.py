"""Files changed or removed at the source leave the spoke (--stale-after), unless a snapshot
in use still holds them. Real hub and spoke processes; the dataset is rewritten in place."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import urllib3

import spokefs
from servers import metric, spoke
from spokefs.mount.process import MountProcess, fuse_unusable

http = urllib3.PoolManager(retries=False)


def snapshot(hub_url: str) -> str:
    r = http.request("POST", f"{hub_url}/v1/datasets/ds/snapshots", body=b"{}",
                     headers={"Content-Type": "application/json"})
    assert r.status in (200, 201), r.data
    return json.loads(r.data)["id"]


def get(base: str, ref: str, rel: str) -> bytes:
    r = http.request("GET", f"{base}/{ref}/{rel}")
    assert r.status == 200, (ref, rel, r.status, r.data[:200])
    return r.data


def resident_files(base: str, snap: str, paths: list[str]) -> set[str]:
    """Which of ``paths`` (files of ``snap``) are wholly resident on the spoke."""
    out = set()
    for p in paths:
        r = http.request("POST", f"{base}/v1/datasets/ds/residency",
                         body=json.dumps({"snapshot": snap, "paths": [p]}).encode(),
                         headers={"Content-Type": "application/json"})
        assert r.status == 200, r.data
        if json.loads(r.data)["resident_files"] == 1:
            out.add(p)
    return out


def stale_status(base: str) -> dict:
    return json.loads(http.request("GET", f"{base}/v1/status").data)["stale"]


def passes(base: str) -> int:
    return int(stale_status(base)["passes"])


def wait_for(what: str, cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


CHANGED, REMOVED, KEPT = "class0/img0000.jpg", "class1/img0001.jpg", "class2/img0002.jpg"


def test_changed_and_removed_files_leave_the_spoke(hub_server, dataset: Path,
                                                   tmp_path: Path) -> None:
    with spoke(hub_server.url, tmp_path / "cache", "256MiB", "--no-prefetch",
               "--stale-after", "2s", "--latest-ttl", "0.2") as s:
        s1 = json.loads(http.request("GET", f"{s.url}/v1/datasets/ds").data)["latest"]
        for rel in (CHANGED, REMOVED, KEPT):
            assert get(s.url, "ds", rel) == (dataset / rel).read_bytes()
        assert resident_files(s.url, s1, [CHANGED, REMOVED, KEPT]) == {CHANGED, REMOVED, KEPT}
        (dataset / CHANGED).write_bytes(b"new bytes" * 1000)
        (dataset / REMOVED).unlink()
        snapshot(hub_server.url)
        # The blocks of the old versions go (one block each); nothing else does.
        wait_for("the stale blocks to leave",
                 lambda: metric(s.url, "spokefs_cache_stale_blocks_total") >= 2)
        assert resident_files(s.url, s1, [CHANGED, REMOVED, KEPT]) == {KEPT}
        assert metric(s.url, "spokefs_cache_stale_blocks_total") == 2
        assert get(s.url, "ds", CHANGED) == b"new bytes" * 1000  # the new version, fetched
        assert get(s.url, "ds", KEPT) == (dataset / KEPT).read_bytes()


@contextlib.contextmanager
def s1_reader(kind: str, base: str, s1: str, rel: str, tmp_path: Path
              ) -> Iterator[Callable[[], tuple[int, bytes]]]:
    """A reader pinned to snapshot ``s1``: plain HTTP reads by path, ``spokefs.open`` (one
    open, then object reads that name the snapshot), or a FUSE mount of ``ds@s1`` (reads
    from the spoke's cache files, reported to it)."""
    if kind == "plain":
        def read() -> tuple[int, bytes]:
            r = http.request("GET", f"{base}/ds@{s1}/{rel}")
            return r.status, r.data
        yield read
    elif kind == "open":
        f = spokefs.open(f"{base}/ds@{s1}/{rel}", buffering=0, deadline=5)

        def read() -> tuple[int, bytes]:
            f.seek(0)
            return 200, f.read()
        yield read
        f.close()
    else:
        if (why := fuse_unusable()) is not None:
            pytest.skip(f"no FUSE: {why}")
        mp = tmp_path / "mnt"
        mp.mkdir()
        with MountProcess(f"{base}/ds@{s1}", mp, "--deadline", "5s"):
            def read() -> tuple[int, bytes]:
                fd = os.open(mp / rel, os.O_RDONLY)
                try:  # past the kernel's page cache: every read reaches the mount
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    return 200, os.pread(fd, 1 << 20, 0)
                finally:
                    os.close(fd)
            yield read


@pytest.mark.parametrize("kind", ["plain", "open", "mount"])
def test_a_snapshot_in_use_keeps_its_files(kind: str, hub_server, dataset: Path,
                                           tmp_path: Path) -> None:
    """S0 -> S1 (C changed) -> S2 (A changed). A reader stays on S1 and reads A, whose S1
    bytes the hub no longer has: they stay cached while it reads, while C's S0 version (in
    no snapshot in use) leaves; once the reader stops, A's S1 version leaves too."""
    a, c = CHANGED, KEPT
    # In use = named within stale-after less one pass (6 s - 1.5 s): wide enough that a busy
    # machine's pause between two of the reader's reads cannot retire what it reads.
    with spoke(hub_server.url, tmp_path / "cache", "256MiB", "--no-prefetch",
               "--stale-after", "6s", "--latest-ttl", "0.2") as s:
        assert get(s.url, "ds", c) == (dataset / c).read_bytes()  # C's S0 version cached
        (dataset / c).write_bytes(b"c1" * 5000)
        s1 = snapshot(hub_server.url)
        old_a = (dataset / a).read_bytes()
        assert get(s.url, f"ds@{s1}", a) == old_a
        assert get(s.url, f"ds@{s1}", c) == b"c1" * 5000
        (dataset / a).write_bytes(b"a2" * 5000)
        snapshot(hub_server.url)

        stop = threading.Event()
        wrong: list[object] = []
        with s1_reader(kind, s.url, s1, a, tmp_path) as read:
            def read_s1() -> None:  # a job pinned to S1 (any worker of the spoke may serve)
                while not stop.is_set():
                    try:
                        status, data = read()
                    except OSError as exc:
                        status, data = -1, str(exc).encode()
                    if status != 200 or data != old_a:
                        wrong.append((status, data[:100]))
                    time.sleep(0.05)

            reader = threading.Thread(target=read_s1)
            reader.start()
            try:
                # Passes long enough after the reader began that only its reads (not the
                # mount's or the open's start) can have kept S1 in use.
                p0 = passes(s.url)
                wait_for("four passes", lambda: passes(s.url) >= p0 + 4)
                assert metric(s.url, "spokefs_cache_stale_blocks_total") == 1  # C's S0 left
                assert s1 in stale_status(s.url)["snapshots_in_use"]["ds"]
                assert resident_files(s.url, s1, [a, c]) == {a, c}  # S1 in use: all kept
            finally:
                stop.set()
                reader.join()
        assert wrong == []
        wait_for("A's S1 version to leave once S1 is not read",
                 lambda: metric(s.url, "spokefs_cache_stale_blocks_total") >= 2)
        assert resident_files(s.url, s1, [a, c]) == {c}
        assert http.request("GET", f"{s.url}/ds@{s1}/{a}").status == 410  # gone at the hub


def test_a_snapshot_named_in_a_report_must_be_an_id(spoke_server) -> None:
    r = http.request("POST", f"{spoke_server.url}/v1/datasets/ds/reads",
                     body=json.dumps({"reads": [], "snapshots": ["../x"]}).encode(),
                     headers={"Content-Type": "application/json"})
    assert r.status == 400 and b"snapshot" in r.data
