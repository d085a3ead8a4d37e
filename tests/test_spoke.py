"""The spoke: read-through correctness, hits, restarts, capacity, failures, integrity."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import urllib3

from servers import metric, output_with, spoke
from spokefs.cache.inspect import OnDisk, blocks_on_disk
from spokefs.manifest import Manifest

http = urllib3.PoolManager(retries=False, maxsize=16)


def get(url: str, **headers: str) -> urllib3.BaseHTTPResponse:
    return http.request("GET", url, headers=headers, redirect=False)


def wait_for_index(cache: Path, n: int, timeout: float = 10.0) -> list[OnDisk]:
    """The blocks in the spoke's committed index, once there are at least ``n`` (it commits
    in batches, every 50 ms)."""
    end = time.monotonic() + timeout
    while True:
        blocks = blocks_on_disk(cache)
        if len(blocks) >= n or time.monotonic() > end:
            assert len(blocks) >= n, f"{len(blocks)} blocks indexed, expected {n}"
            return blocks
        time.sleep(0.02)


def read_all(base: str, dataset: Path) -> int:
    n = 0
    for p in sorted(dataset.rglob("*")):
        if p.is_file():
            rel = p.relative_to(dataset).as_posix()
            r = get(f"{base}/ds/{rel}")
            assert r.status == 200, (rel, r.data[:200])
            assert r.data == p.read_bytes(), rel
            n += len(r.data)
    return n


def test_read_through_then_hits(spoke_server, dataset: Path) -> None:
    base = spoke_server.url
    total = read_all(base, dataset)
    fetched = metric(base, "spokefs_upstream_bytes_total")
    assert fetched == total  # every byte crossed once
    misses = metric(base, "spokefs_cache_misses_total")
    read_all(base, dataset)
    assert metric(base, "spokefs_upstream_bytes_total") == fetched  # warm pass: nothing moved
    assert metric(base, "spokefs_cache_misses_total") == misses
    assert metric(base, "spokefs_cache_hits_total") >= misses


def test_ranges_across_blocks(spoke_server, dataset: Path) -> None:
    src = (dataset / "shards/shard-000.tar").read_bytes()
    bs = 4 * 1024 * 1024
    for a, b in [(0, 10), (bs - 5, bs + 5), (bs - 1, 2 * bs + 1), (len(src) - 7, len(src) - 1)]:
        r = get(f"{spoke_server.url}/ds/shards/shard-000.tar", Range=f"bytes={a}-{b}")
        assert r.status == 206 and r.data == src[a:b + 1], (a, b)
    r = get(f"{spoke_server.url}/ds/shards/shard-000.tar", Range=f"bytes={len(src)}-")
    assert r.status == 416


def test_concurrent_readers_share_one_fetch(spoke_server, dataset: Path) -> None:
    src = (dataset / "shards/shard-000.tar").read_bytes()
    results: list[bytes] = []

    def reader() -> None:
        results.append(get(f"{spoke_server.url}/ds/shards/shard-000.tar").data)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == src for r in results)
    assert metric(spoke_server.url, "spokefs_upstream_bytes_total") == len(src)


def test_cache_survives_restart(hub_server, dataset: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with spoke(hub_server.url, cache) as s1:
        total = read_all(s1.url, dataset)
    with spoke(hub_server.url, cache) as s2:
        read_all(s2.url, dataset)
        assert metric(s2.url, "spokefs_upstream_bytes_total") == 0
        assert metric(s2.url, "spokefs_cache_bytes") == total


def test_cache_size_is_a_hard_bound(hub_server, dataset: Path, tmp_path: Path) -> None:
    cap = 6 * 1024 * 1024
    with spoke(hub_server.url, tmp_path / "cache", str(cap)) as s:
        read_all(s.url, dataset)
        assert metric(s.url, "spokefs_cache_bytes") <= cap
        assert metric(s.url, "spokefs_cache_evictions_total") > 0
        # What the files hold on disk (they are sparse: st_blocks, not st_size).
        on_disk = sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache/segments").iterdir())
        assert on_disk <= cap + 64 * 1024  # ext4's extent blocks


def test_upstream_down_cached_served_uncached_503(hub_server, dataset: Path,
                                                  tmp_path: Path) -> None:
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--deadline", "1.5s") as s:
        src = (dataset / "class0/img0000.jpg").read_bytes()
        assert get(f"{s.url}/ds/class0/img0000.jpg").data == src
        m = Manifest.decode(get(f"{s.url}/v1/datasets/ds/snapshots/latest/manifest").data)
        hub_server.stop()
        # Cached: still served, metadata included.
        assert get(f"{s.url}/ds/class0/img0000.jpg").data == src
        # Uncached: a clear 503 after the deadline, not a hang.
        t0 = time.monotonic()
        r = get(f"{s.url}/v1/datasets/ds/objects/{m.lookup('class1/img0001.jpg').version}")
        elapsed = time.monotonic() - t0
        assert r.status == 503
        err = json.loads(r.data)["error"]
        # The kind of failure, never the upstream's address or raw error text (in the log).
        assert err["code"] == "upstream_unavailable" and err["cause"] == "cannot connect"
        assert hub_server.hostport not in r.data.decode() and "Errno" not in r.data.decode()
        assert "the upstream" in err["message"]
        assert 1.0 <= elapsed < 10
        # The spoke itself stays healthy.
        assert get(f"{s.url}/v1/status").status == 200


def test_corrupt_block_is_detected_refetched_counted(spoke_server, dataset: Path,
                                                     tmp_path: Path) -> None:
    base = spoke_server.url
    src = (dataset / "class3/img0003.jpg").read_bytes()
    assert get(f"{base}/ds/class3/img0003.jpg").data == src
    blocks = wait_for_index(tmp_path / "cache", 1)
    for b in blocks:  # flip a byte in every cached block
        with open(b.path, "r+b") as f:
            at = b.offset + b.size // 2
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))
    fetched = metric(base, "spokefs_upstream_bytes_total")
    assert get(f"{base}/ds/class3/img0003.jpg").data == src
    assert metric(base, "spokefs_integrity_failures_total") >= 1
    assert metric(base, "spokefs_upstream_bytes_total") == fetched + len(src)


def test_unwritable_cache_passes_through(hub_server, dataset: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0 and not shutil.which("mount"):
        pytest.skip("needs mount(8) for a tiny tmpfs")
    cache = tmp_path / "cache"
    with spoke(hub_server.url, cache) as s:
        # Make the segment folder read-only to every writer, root included: a read-only bind.
        seg = cache / "segments"
        os.system(f"mount --bind -o ro {seg} {seg} 2>/dev/null")
        seg_ro = os.system(f"mount -o remount,bind,ro {seg} 2>/dev/null") == 0
        try:
            if not seg_ro:
                pytest.skip("cannot make the cache read-only here")
            try:
                assert read_all(s.url, dataset) > 0
            except AssertionError:
                print(''.join(s.output))
                raise
            assert metric(s.url, "spokefs_cache_writable") == 0
            assert metric(s.url, "spokefs_cache_write_errors_total") >= 1
            assert metric(s.url, "spokefs_passthrough_bytes_total") > 0
            assert output_with(s, "cannot write to").count("cannot write to") == 1  # once
        finally:
            os.system(f"umount {seg} 2>/dev/null")


def test_new_version_never_mixes(hub_server, dataset: Path, tmp_path: Path) -> None:
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--latest-ttl", "0s") as s:
        old = (dataset / "class1/img0005.jpg").read_bytes()
        snap1 = json.loads(get(f"{s.url}/v1/datasets/ds").data)["latest"]
        assert get(f"{s.url}/ds@{snap1}/class1/img0005.jpg").data == old
        (dataset / "class1/img0005.jpg").write_bytes(b"v2" * 1000)
        http.request("POST", f"{hub_server.url}/v1/datasets/ds/snapshots")
        # New snapshot: new bytes; the pinned snapshot: old bytes from the cache.
        assert get(f"{s.url}/ds/class1/img0005.jpg").data == b"v2" * 1000
        assert get(f"{s.url}/ds@{snap1}/class1/img0005.jpg").data == old
        # A pinned version that was never cached and is gone on the hub: a clear 410.
        (dataset / "class1/img0009.jpg").write_bytes(b"v2")
        r = get(f"{s.url}/ds@{snap1}/class1/img0009.jpg")
        assert r.status == 410
        assert json.loads(r.data)["error"]["code"] == "version_gone"


def test_spoke_chains_to_spoke(spoke_server, dataset: Path, tmp_path: Path) -> None:
    with spoke(spoke_server.url, tmp_path / "cache2") as edge:
        read_all(edge.url, dataset)
        read_all(edge.url, dataset)
        assert metric(edge.url, "spokefs_integrity_failures_total") == 0


@pytest.mark.parametrize(("workers", "prefetch", "bound"), [
    ("1", False, 40 << 20), ("2", False, 40 << 20),
    # With prediction on, the planner's readahead (64 MiB at most) runs ahead of what was
    # sent too, but no further: it hears the read block by block as it goes out.
    ("1", True, 104 << 20)])
def test_an_abandoned_read_of_a_huge_range_pulls_one_window(
        tmp_path: Path, workers: str, prefetch: bool, bound: int) -> None:
    import socket

    from servers import hub, make_dataset

    ds = make_dataset(tmp_path / "ds", n_small=1, big_sizes=(192 << 20,))
    extra = [] if prefetch else ["--no-prefetch"]
    with hub(ds, tmp_path / "hubstate") as h, \
            spoke(h.url, tmp_path / "cache", "1GiB", "--read-window", "8MiB", *extra,
                  "--workers", workers) as s:
        host, port = s.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.connect((host, int(port)))
        sock.sendall(b"GET /ds/shards/shard-000.tar HTTP/1.1\r\nHost: x\r\n\r\n")
        got = 0
        while got < 1 << 20:  # the reader takes 1 MiB of 192, then goes away
            got += len(sock.recv(1 << 16))
        sock.close()
        end = time.monotonic() + 30
        while metric(s.url, "spokefs_upstream_inflight") and time.monotonic() < end:
            time.sleep(0.05)
        assert metric(s.url, "spokefs_upstream_inflight") == 0
        pulled = metric(s.url, "spokefs_upstream_bytes_total")
        # One window (2 blocks) ahead of what was sent, plus what the socket buffers took:
        # never the whole 192 MiB the request asked for.
        assert 0 < pulled <= bound, pulled
        # And the spoke is fine: a whole read of the same file still works.
        r = get(f"{s.url}/ds/shards/shard-000.tar")
        assert r.status == 200 and r.data == (ds / "shards/shard-000.tar").read_bytes()


def test_slow_clients_are_closed_and_connections_capped(hub_server, tmp_path: Path) -> None:
    import socket

    from servers import ServerProcess

    s = ServerProcess("spoke", "serve", "--upstream", hub_server.url, "--cache-dir",
                      str(tmp_path / "cache"), "--cache-size", "64MiB", "--port", "0",
                      "--workers", "1", env={"SPOKEFS_IDLE_TIMEOUT": "2",
                                             "SPOKEFS_MAX_CONNECTIONS": "4"})
    with s:
        host, port = s.url.removeprefix("http://").split(":")

        def connect() -> socket.socket:
            c = socket.create_connection((host, int(port)), timeout=10)
            return c

        # Headers that never finish: closed after the idle timeout, not held forever.
        slow = connect()
        slow.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the server (a hang fails at 10 s)
        assert time.monotonic() - t0 < 5
        slow.close()
        # Connections over the cap get a 503 at once; the ones within it are served.
        held = [connect() for _ in range(4)]
        for c in held:  # each served once (so the server has surely taken it), kept open
            c.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
        try:
            over = connect()
            answer = over.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
            over.close()
        finally:
            for c in held:
                c.close()
        end = time.monotonic() + 10
        while True:  # the server sees the held ones go, then serves again
            r = get(f"{s.url}/v1/status")
            if r.status == 200 or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert r.status == 200


def test_warm_pins_are_bounded_and_lapse(hub_server, dataset: Path, tmp_path: Path) -> None:
    def warm(base: str, doc: dict) -> urllib3.BaseHTTPResponse:
        return http.request("POST", f"{base}/v1/datasets/ds/warm", body=json.dumps(doc),
                            headers={"Content-Type": "application/json"})

    def pinned(base: str) -> int:
        return json.loads(get(f"{base}/v1/status").data)["cache"]["warm_pinned_bytes"]

    with spoke(hub_server.url, tmp_path / "cache", "14MiB", "--pin-ttl", "1s") as s:
        # The shards (13.2 MB) would pin more than 80% of a 14 MiB cache: refused, no pins.
        r = warm(s.url, {"prefix": "shards/", "pin": True})
        assert r.status == 400 and "pin at most" in json.loads(r.data)["error"]["message"]
        assert pinned(s.url) == 0
        small = sum(p.stat().st_size for p in (dataset / "class0").iterdir())
        assert warm(s.url, {"prefix": "class0/", "pin": True}).status == 202
        assert pinned(s.url) == small
        r = http.request("POST", f"{s.url}/v1/datasets/ds/unpin",
                         body=json.dumps({"prefix": "class0/"}),
                         headers={"Content-Type": "application/json"})
        assert r.status == 200 and pinned(s.url) == 0  # released on request
        assert warm(s.url, {"prefix": "class0/", "pin": True}).status == 202
        assert pinned(s.url) == small
        end = time.monotonic() + 20  # the pins lapse after --pin-ttl (checked every 5 s)
        while pinned(s.url) and time.monotonic() < end:
            time.sleep(0.2)
        assert pinned(s.url) == 0
