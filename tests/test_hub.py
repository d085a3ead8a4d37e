"""The hub: snapshots that remember their work, the v1 API, plain reads, path safety."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import urllib3

from spokefs.hub.snapshot import HubState
from spokefs.manifest import Manifest

http = urllib3.PoolManager(retries=False)


def get(url: str, **headers: str) -> urllib3.BaseHTTPResponse:
    return http.request("GET", url, headers=headers, redirect=False)


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
    assert m.lookup("inside.jpg") is not None
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
