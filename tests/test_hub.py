"""The hub: snapshots that remember their work, the v1 API, plain reads, path safety."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import urllib3
from aiohttp import web

from servers import hub
from spokefs.hub.backend import HubBackend
from spokefs.hub.snapshot import HubState, ScanResult
from spokefs.manifest import Manifest
from spokefs.wire.server import build_app

http = urllib3.PoolManager(retries=False)
# A hub that hangs (a blocking open, a lock held by a scan) fails the test instead of blocking it.
PROMPT = urllib3.Timeout(connect=5, read=10)


def get(url: str, **headers: str) -> urllib3.BaseHTTPResponse:
    return http.request("GET", url, headers=headers, redirect=False, timeout=PROMPT)


def latest_manifest(base: str) -> Manifest:
    return Manifest.decode(get(f"{base}/v1/datasets/ds/snapshots/latest/manifest").data)


def assert_gone(r: urllib3.BaseHTTPResponse, why: str) -> None:
    assert r.status == 410, r.data
    err = json.loads(r.data)["error"]
    assert err["code"] == "version_gone" and why in err["message"], err


@contextlib.contextmanager
def serve_in_thread(backend: HubBackend) -> Iterator[str]:
    """The hub's app on a real socket, its event loop in a thread of this process: a test can
    hold the hub's scan at a point of its choosing and read meanwhile."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(backend), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


class GatedState(HubState):
    """A hub state whose scans wait inside the hashing of each file until ``release`` is set:
    a snapshot in progress, held for as long as a test needs."""

    def __init__(self, root: Path, state_dir: Path, name: str) -> None:
        super().__init__(root, state_dir, name)
        self.hashing = threading.Event()
        self.release = threading.Event()

    def _hash_file(self, path: str, listed: os.stat_result,
                   progress: Callable[[int], object]) -> tuple[os.stat_result, list[bytes]]:
        self.hashing.set()
        assert self.release.wait(60), "the test never released the scan"
        return super()._hash_file(path, listed, progress)


def scan_in_thread(st: HubState) -> tuple[threading.Thread, list[ScanResult]]:
    result: list[ScanResult] = []
    t = threading.Thread(target=lambda: result.append(st.scan()), daemon=True)
    t.start()
    return t, result


def test_rescan_rereads_only_changed_files(dataset: Path, tmp_path: Path) -> None:
    st = HubState(dataset, tmp_path / "state", "ds").open()
    first = st.scan()
    n = first.snapshot.files
    assert first.created_new and first.files_hashed == n
    again = st.scan()
    assert not again.created_new and again.files_hashed == 0
    assert again.snapshot.id == first.snapshot.id
    (dataset / "class0" / "img0000.jpg").write_bytes(b"changed")
    third = st.scan()
    assert third.created_new and third.files_hashed == 1
    assert [s.id for s in st.snapshots()] == [first.snapshot.id, third.snapshot.id]
    st.close()
    # A restarted hub keeps the work too.
    st2 = HubState(dataset, tmp_path / "state", "ds").open()
    assert st2.scan().files_hashed == 0
    st2.close()


def test_symlinks_out_of_tree_are_not_published(dataset: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    os.symlink(secret, dataset / "escape.txt")
    os.symlink("class0/img0000.jpg", dataset / "inside.jpg")
    st = HubState(dataset, tmp_path / "state", "ds").open()
    snap = st.scan().snapshot
    m = Manifest.decode(st.manifest_path(snap.id).read_bytes())
    assert m.lookup("escape.txt") is None
    inside = m.lookup("inside.jpg")
    assert inside is not None
    # Served from its target: reads never open a symlink.
    with serve_in_thread(HubBackend([st])) as base:
        r = get(f"{base}/ds/inside.jpg")
        assert r.status == 200 and r.data == (dataset / "class0/img0000.jpg").read_bytes()
    st.close()


def test_api_lists_and_serves(ro_hub, ro_dataset: Path) -> None:
    base, dataset = ro_hub.url, ro_dataset
    doc = json.loads(get(f"{base}/v1/datasets").data)
    assert [d["name"] for d in doc["datasets"]] == ["ds"]
    snap = doc["datasets"][0]["latest"]
    r = get(f"{base}/v1/datasets/ds/snapshots/{snap}/manifest")
    assert r.headers["Content-Encoding"] == "gzip"
    m = Manifest.decode(r.data)
    assert m.snapshot == snap
    assert {e.path for e in m.entries()} == {
        str(p.relative_to(dataset)) for p in dataset.rglob("*") if p.is_file()}
    assert "empty_dir" in m.dirs
    e = m.lookup("shards/shard-000.tar")
    src = (dataset / "shards/shard-000.tar").read_bytes()
    r = get(f"{base}/v1/datasets/ds/objects/{e.version}", Range="bytes=100-4194403")
    assert r.status == 206 and r.data == src[100:4194404]
    assert r.headers["Content-Range"] == f"bytes 100-4194403/{len(src)}"
    # Exactly one block: the digest rides along.
    r = get(f"{base}/v1/datasets/ds/objects/{e.version}", Range="bytes=0-4194303")
    assert len(r.headers["X-Spokefs-Block-Digest"]) == 32
    entry = json.loads(get(f"{base}/v1/datasets/ds/snapshots/latest/entries/class1").data)
    assert entry["type"] == "dir" and len(entry["files"]) == 5


def test_plain_reads_head_and_index(ro_hub, ro_dataset: Path) -> None:
    base, dataset = ro_hub.url, ro_dataset
    src = (dataset / "class2/img0002.jpg").read_bytes()
    assert get(f"{base}/ds/class2/img0002.jpg").data == src
    r = get(f"{base}/ds/class2/img0002.jpg", Range="bytes=-10")
    assert r.status == 206 and r.data == src[-10:]
    h = http.request("HEAD", f"{base}/ds/class2/img0002.jpg")
    assert int(h.headers["Content-Length"]) == len(src) and h.data == b""
    index = get(f"{base}/ds/class2/").data.decode()
    assert 'href="img0002.jpg"' in index
    assert get(f"{base}/ds/class2").status == 301
    snap = json.loads(get(f"{base}/v1/datasets/ds").data)["latest"]
    assert get(f"{base}/ds@{snap}/class2/img0002.jpg").data == src
    assert get(f"{base}/ds/empty.txt").data == b""


@pytest.mark.parametrize(("path", "status"), [
    ("/nope/x", 404), ("/ds/no/such/file", 404), ("/ds@ffffffffffff/class0/img0000.jpg", 404),
    ("/v1/datasets/nope", 404), ("/v1/datasets/ds/objects/" + "0" * 32, 410),
    ("/ds/%2e%2e/%2e%2e/etc/passwd", 400), ("/ds/class0/..%2f..%2fetc", 400),
    ("/ds/%00x", 400), ("/v1/datasets/ds/snapshots/latest/entries/%2e%2e/x", 400)])
def test_bad_requests_get_json_errors(ro_hub, path: str, status: int) -> None:
    r = http.request("GET", ro_hub.url + path, redirect=False)
    assert r.status == status, r.data
    assert "error" in json.loads(r.data)


def test_batch_read_body_that_arrives_in_pieces(ro_hub) -> None:
    """The body of a batch read is read whole, however it arrives: the server's own reader
    (one ``content.read(n)``) took the first piece for the body, and a body cut by the
    network was "not JSON" (400)."""
    m = Manifest.decode(http.request(
        "GET", f"{ro_hub.url}/v1/datasets/ds/snapshots/latest/manifest").data)
    body = json.dumps({"blocks": [[v, 0] for v in m.versions[:8]]}).encode()
    head = (f"POST /v1/datasets/ds/blocks HTTP/1.1\r\nHost: hub\r\nContent-Length: "
            f"{len(body)}\r\nConnection: close\r\n\r\n").encode()
    host, port = ro_hub.hostport.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body[:40])
        time.sleep(0.3)  # the server has read the first piece by now
        s.sendall(body[40:])
        status = s.makefile("rb").readline()
    assert status.split()[1] == b"200", status


def test_ranges_past_the_end(ro_hub, ro_dataset: Path) -> None:
    base, dataset = ro_hub.url, ro_dataset
    size = (dataset / "class0/img0000.jpg").stat().st_size
    r = get(f"{base}/ds/class0/img0000.jpg", Range=f"bytes={size}-")
    assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{size}"
    assert get(f"{base}/ds/class0/img0000.jpg", Range="bytes=oops").status == 400
    for odd in ("bytes=\u00b2-3", "bytes=0-\u00b9", "bytes=" + "9" * 5000 + "-"):
        r = get(f"{base}/ds/class0/img0000.jpg", Range=odd)  # digits only int() would refuse
        assert r.status == 400 and "Range" in json.loads(r.data)["error"]["message"], odd
    r = get(f"{base}/ds/class0/img0000.jpg", Range=f"bytes={size - 5}-{size + 100}")
    assert r.status == 206 and len(r.data) == 5


def test_changed_file_is_gone_never_mixed(hub_server, dataset: Path) -> None:
    base = hub_server.url
    m = Manifest.decode(get(f"{base}/v1/datasets/ds/snapshots/latest/manifest").data)
    e = m.lookup("class0/img0004.jpg")
    (dataset / "class0/img0004.jpg").write_bytes(b"new content")
    r = get(f"{base}/v1/datasets/ds/objects/{e.version}")
    assert r.status == 410
    assert json.loads(r.data)["error"]["code"] == "version_gone"
    # A new snapshot through the API publishes the change; the old one stays listed.
    r = http.request("POST", f"{base}/v1/datasets/ds/snapshots")
    assert r.status == 201 and json.loads(r.data)["new"] is True
    doc = json.loads(get(f"{base}/v1/datasets/ds").data)
    assert len(doc["snapshots"]) == 2
    assert get(f"{base}/ds/class0/img0004.jpg").data == b"new content"


# -- a hostile or changing source tree ---------------------------------------------------------
def test_fifo_swapped_over_a_published_file_is_gone_not_a_hang(hub_server, dataset: Path
                                                               ) -> None:
    base = hub_server.url
    m = latest_manifest(base)
    cached, fresh = m.lookup("class0/img0000.jpg"), m.lookup("class1/img0001.jpg")
    assert cached is not None and fresh is not None
    # One read first: the hub now keeps that file open, the other it must open anew.
    assert get(f"{base}/v1/datasets/ds/objects/{cached.version}").status == 200
    for e in (cached, fresh):
        (dataset / e.path).unlink()
        os.mkfifo(dataset / e.path)  # no writer: a blocking open would never return
        assert_gone(get(f"{base}/v1/datasets/ds/objects/{e.version}"), "FIFO")
    assert_gone(get(f"{base}/ds/class1/img0001.jpg"), "FIFO")
    # The hub is unharmed, and a new snapshot leaves the FIFOs out.
    src = (dataset / "class2/img0002.jpg").read_bytes()
    assert get(f"{base}/ds/class2/img0002.jpg").data == src
    r = http.request("POST", f"{base}/v1/datasets/ds/snapshots", timeout=PROMPT)
    assert r.status == 201
    m2 = latest_manifest(base)
    assert m2.lookup(cached.path) is None and m2.lookup(fresh.path) is None


def test_symlink_swapped_over_a_published_file_is_gone(hub_server, dataset: Path,
                                                       tmp_path: Path) -> None:
    base = hub_server.url
    m = latest_manifest(base)
    e, same = m.lookup("class3/img0003.jpg"), m.lookup("class3/img0007.jpg")
    assert e is not None and same is not None
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"top secret")
    (dataset / e.path).unlink()
    os.symlink(secret, dataset / e.path)
    r = get(f"{base}/v1/datasets/ds/objects/{e.version}")
    assert_gone(r, "symbolic link")
    assert b"top secret" not in r.data
    assert_gone(get(f"{base}/ds/{e.path}"), "symbolic link")
    # Even a symlink to the very file published (another name of its inode) is refused.
    os.link(dataset / same.path, tmp_path / "alias.jpg")
    (dataset / same.path).unlink()
    os.symlink(tmp_path / "alias.jpg", dataset / same.path)
    assert_gone(get(f"{base}/v1/datasets/ds/objects/{same.version}"), "symbolic link")


def test_rewrite_with_size_and_mtime_put_back_is_gone(hub_server, dataset: Path) -> None:
    """``cp -p`` over a published file: same inode, same size, the old mtime restored. Only
    the ctime tells, and the hub must not serve the new bytes under the old version."""
    base = hub_server.url
    e = latest_manifest(base).lookup("class1/img0005.jpg")
    assert e is not None
    path = dataset / e.path
    old = path.stat()
    r = get(f"{base}/v1/datasets/ds/objects/{e.version}")  # the hub keeps it open now
    assert r.status == 200 and r.data == path.read_bytes()
    with path.open("r+b") as f:  # rewritten in place, as cp does onto an existing file
        f.write(bytes(old.st_size))
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = path.stat()
    assert (new.st_ino, new.st_size, new.st_mtime_ns) == (old.st_ino, old.st_size,
                                                          old.st_mtime_ns)
    assert_gone(get(f"{base}/v1/datasets/ds/objects/{e.version}"), "changed")
    assert_gone(get(f"{base}/ds/{e.path}"), "changed")


def test_names_that_are_not_utf8_are_left_out(dataset: Path, tmp_path: Path) -> None:
    root = os.fsencode(dataset)
    fd = os.open(root + b"/class0/\xff.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"not published")
    os.close(fd)
    os.mkdir(root + b"/\xfe-dir")
    (Path(os.fsdecode(root + b"/\xfe-dir")) / "inner.bin").write_bytes(b"nor this")
    os.mkdir(root + b"/class1/\xfd")  # an empty folder
    with hub(dataset, tmp_path / "hubstate") as h:
        base = h.url
        r = get(f"{base}/v1/datasets/ds/snapshots/latest/manifest")
        assert r.status == 200
        m = Manifest.decode(r.data)
        published = {str(p.relative_to(dataset)) for p in dataset.rglob("*")
                     if p.is_file() and "\\udc" not in ascii(str(p))}
        assert set(m.paths) == published and "class0/img0000.jpg" in published
        assert all("\\udc" not in ascii(d) for d in m.dirs)
        for folder in ("", "class0/", "class1/"):
            assert get(f"{base}/ds/{folder}").status == 200, folder
        r = get(f"{base}/v1/datasets/ds/snapshots/latest/entries/class0")
        assert r.status == 200 and len(json.loads(r.data)["files"]) == 5
        src = (dataset / "class0/img0004.jpg").read_bytes()
        assert get(f"{base}/ds/class0/img0004.jpg").data == src
        r = http.request("POST", f"{base}/v1/datasets/ds/snapshots", timeout=PROMPT)
        assert r.status == 201 and json.loads(r.data)["new"] is False
        # One line per name, at the first scan and at the second (the hub's output is read
        # by a thread: the second scan's lines may arrive a moment after its answer).
        end = time.monotonic() + 10
        while True:
            warned = [line for line in h.output if "not valid UTF-8" in line]
            if len(warned) >= 6 or time.monotonic() > end:
                break
            time.sleep(0.05)
    assert len(warned) == 6, warned


def test_reads_are_served_while_a_snapshot_is_in_progress(dataset: Path, tmp_path: Path
                                                          ) -> None:
    st = GatedState(dataset, tmp_path / "state", "ds").open()
    st.release.set()
    first = st.scan().snapshot
    st.release.clear()
    st.hashing.clear()
    e = Manifest.decode(st.manifest_path(first.id).read_bytes()).lookup("shards/shard-000.tar")
    assert e is not None
    src = (dataset / e.path).read_bytes()
    (dataset / "class0/img0000.jpg").write_bytes(b"changed")  # something for the scan to hash
    with serve_in_thread(HubBackend([st])) as base:
        scan, result = scan_in_thread(st)
        try:
            assert st.hashing.wait(30)
            # The scan is inside its hashing now, holding whatever a scan holds. The hub's
            # first request checks the state database for outside changes, a version it does
            # not know asks again: neither may wait for the scan.
            r = get(f"{base}/v1/datasets/ds/objects/{e.version}", Range="bytes=0-1048575")
            assert r.status == 206 and r.data == src[:1 << 20]
            assert get(f"{base}/v1/datasets/ds/objects/{'0' * 32}").status == 410
            assert json.loads(get(f"{base}/v1/datasets/ds").data)["latest"] == first.id
            assert get(f"{base}/ds/class1/").status == 200
        finally:
            st.release.set()
            scan.join(60)
        assert not scan.is_alive() and result[0].created_new and result[0].files_hashed == 1
        # Published at once, without waiting for a refresh.
        assert json.loads(get(f"{base}/v1/datasets/ds").data)["latest"] == result[0].snapshot.id
        assert get(f"{base}/ds/class0/img0000.jpg").data == b"changed"
    st.close()


def test_file_swapped_for_a_fifo_during_the_scan_is_left_out(dataset: Path,
                                                              tmp_path: Path) -> None:
    st = GatedState(dataset, tmp_path / "state", "ds").open()
    st.release.set()
    st.scan()
    st.release.clear()
    st.hashing.clear()
    path = dataset / "class2/img0006.jpg"
    path.write_bytes(b"changed")
    scan, result = scan_in_thread(st)
    assert st.hashing.wait(30)  # listed as a regular file, about to be hashed
    path.unlink()
    os.mkfifo(path)
    st.release.set()
    scan.join(30)
    if scan.is_alive():  # stuck opening the FIFO: give it a writer so the thread can end
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the scan blocked on a FIFO")
    m = Manifest.decode(st.manifest_path(result[0].snapshot.id).read_bytes())
    assert m.lookup("class2/img0006.jpg") is None and m.lookup("class2/img0002.jpg") is not None
    st.close()


def test_state_from_before_devices_were_kept_is_migrated_without_rehashing(
        dataset: Path, tmp_path: Path) -> None:
    st = HubState(dataset, tmp_path / "state", "ds").open()
    first = st.scan().snapshot
    st.close()
    # Back to the first table format: no dev, no src.
    db = sqlite3.connect(tmp_path / "state" / "state.sqlite", isolation_level=None)
    db.executescript("""
        BEGIN;
        CREATE TABLE old (path TEXT PRIMARY KEY, ino INTEGER, size INTEGER, mtime_ns INTEGER,
            ctime_ns INTEGER, mode INTEGER, version TEXT, digests BLOB);
        INSERT INTO old SELECT path, ino, size, mtime_ns, ctime_ns, mode, version, digests
            FROM files;
        DROP TABLE files;
        ALTER TABLE old RENAME TO files;
        CREATE INDEX files_version ON files(version);
        COMMIT;""")
    db.close()
    st = HubState(dataset, tmp_path / "state", "ds").open()
    again = st.scan()
    assert again.files_hashed == 0 and again.snapshot.id == first.id
    e = Manifest.decode(st.manifest_path(first.id).read_bytes()).lookup("class0/img0000.jpg")
    assert e is not None
    stored = st.stored(e.version)
    assert stored is not None and stored.dev == (dataset / e.path).stat().st_dev
    st.close()
