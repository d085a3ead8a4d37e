"""A writable dataset at a real hub process: uploads with write tokens only, checked whole
against the version declared, resumed from the bytes held, published by a commit as one new
snapshot whole or not at all; a commit a crash left is finished by the next scan; nothing
escapes the dataset's folder; the snapshots before stay readable."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import urllib3

from servers import CuttingProxy, ServerProcess, hub
from spokefs import integrity
from spokefs.client.sync import Client
from spokefs.client.uploads import Uploader, file_version, put_tree
from spokefs.errors import ConfigError, Conflict, DigestMismatch, Forbidden
from spokefs.hub.namespace import parse_datasets
from spokefs.hub.snapshot import HubState
from spokefs.hub.uploads import Incoming, Upload, _key
from spokefs.manifest import Manifest
from spokefs.origin.folder import INCOMING
from spokefs.procs import StartError
from spokefs.wire.headers import H_OFFSET, H_SIZE, H_VERSION

BLOCK = 64 * 1024
WRITER = "writer-" + "w" * 32      # write:ckpt
OTHER_WRITER = "owriter-" + "o" * 32  # write:ro (a read-only dataset)
READER = "reader-" + "r" * 32      # read:ckpt
ADMIN = "admin-" + "a" * 32

pool = urllib3.PoolManager(retries=False, timeout=30)


def put(base: str, ds: str, path: str, data: bytes, token: str | None = WRITER,
        size: int | None = None, offset: int = 0, version: str | None = None
        ) -> urllib3.BaseHTTPResponse:
    """A raw PUT of ``data`` as the bytes of ``path`` from ``offset``."""
    headers = {H_SIZE: str(len(data) if size is None else size), H_OFFSET: str(offset),
               H_VERSION: version or "0" * 32, "Content-Type": "application/octet-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return pool.request("PUT", f"{base}/v1/datasets/{ds}/uploads/{path}", body=data,
                        headers=headers)


def version_of(data: bytes) -> str:
    digests = [integrity.block_digest(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]
    return integrity.version_id(len(data), BLOCK, digests)


def files_of(base: str, ds: str, token: str = READER) -> dict[str, dict]:
    m = Client(base, token=token).manifest(ds, "latest")
    return {p: {"size": n, "version": v} for p, n, v in zip(m.paths, m.sizes, m.versions,
                                                             strict=True)}


def metric(base: str, name: str, **labels: str) -> float:
    text = pool.request("GET", f"{base}/metrics",
                        headers={"Authorization": f"Bearer {ADMIN}"}).data.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def read_back(base: str, ds: str, version: str, size: int, token: str = READER) -> bytes:
    return Client(base, token=token).read(ds, version, 0, size) if size else b""


@pytest.fixture
def writable(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path, Path]]:
    ckpt = tmp_path / "ckpt"
    (ckpt / "old").mkdir(parents=True)
    (ckpt / "old" / "step-0.pt").write_bytes(b"the first checkpoint\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "a.txt").write_text("read only\n")
    tokens = tmp_path / "hub.tokens"
    tokens.write_text(f"w write:ckpt {WRITER}\nrw write:ro {OTHER_WRITER}\n"
                      f"r read:ckpt {READER}\nadmin admin {ADMIN}\n")
    with hub(ckpt, tmp_path / "state", "--block-size", str(BLOCK), "--dataset", f"ro={ro}",
             "--writable", "ckpt", "--auth", str(tokens)) as h:
        yield h, ckpt, tmp_path


def test_a_commit_publishes_every_file_at_once_and_the_old_snapshot_stays(writable, tmp_path
                                                                         ) -> None:
    h, ckpt, _ = writable
    before = Client(h.url, token=READER).resolve("ckpt", "latest")
    local = tmp_path / "local"
    rng = random.Random(3)
    want = {"rank0.pt": rng.randbytes(3 * BLOCK + 17), "rank1.pt": rng.randbytes(5),
            "nested/shard.bin": rng.randbytes(BLOCK), ".metadata": b"", "sub/empty": b""}
    for rel, data in want.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    up = Uploader(h.url, "ckpt", token=WRITER)
    sent = put_tree(up, local, "step-100")
    assert sorted(s.path for s in sent) == sorted(f"step-100/{p}" for p in want)
    assert all(s.sent == s.size for s in sent)

    # Whole and checked, but no reader sees any of it before the commit.
    assert sorted(u["path"] for u in up.listing() if u["whole"]) == sorted(
        f"step-100/{p}" for p in want)
    assert not [p for p in files_of(h.url, "ckpt") if p.startswith("step-100/")]
    assert not (ckpt / "step-100").exists()

    doc = up.commit(prefix="step-100/")
    assert sorted(doc["committed"]) == sorted(f"step-100/{p}" for p in want)
    assert doc["new"] and doc["files_hashed"] == 0  # digested as they came in, not again
    after = files_of(h.url, "ckpt")
    for rel, data in want.items():
        entry = after[f"step-100/{rel}"]
        assert entry == {"size": len(data), "version": version_of(data)}
        # Served: the row's identity is the file's as it stays (no 410 after the commit).
        assert read_back(h.url, "ckpt", entry["version"], len(data)) == data
        assert (ckpt / "step-100" / rel).read_bytes() == data
    assert up.listing() == []
    assert not any((ckpt / INCOMING).iterdir())
    # The snapshot before still lists what it had, and only that.
    old = Client(h.url, token=READER).manifest("ckpt", before)
    assert old.paths == ["old/step-0.pt"]
    # Counted: the bytes received and the files published.
    assert metric(h.url, "spokefs_hub_upload_bytes_total", dataset="ckpt") == sum(
        map(len, want.values()))
    assert metric(h.url, "spokefs_hub_committed_files_total", dataset="ckpt") == len(want)
    # A second scan finds nothing new: the rows recorded are the files as they are.
    r = pool.request("POST", f"{h.url}/v1/datasets/ckpt/snapshots",
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status in (200, 201) and not json.loads(r.data)["new"], r.data


def test_only_a_write_token_of_a_writable_dataset_may_upload(writable) -> None:
    h, ckpt, _ = writable
    data = b"x" * 100
    v = version_of(data)
    for token, status in ((None, 401), ("nobody-" + "n" * 32, 401), (READER, 403)):
        r = put(h.url, "ckpt", "a.pt", data, token=token, version=v)
        assert r.status == status, r.data
        if token:
            assert token.encode() not in r.data
    # A write token of another dataset: not this one.
    r = put(h.url, "ckpt", "a.pt", data, token=OTHER_WRITER, version=v)
    assert r.status == 403 and b"may not write dataset 'ckpt'" in r.data, r.data
    # A read-only dataset refuses its own write token, and an admin's: it is not writable.
    for token in (OTHER_WRITER, ADMIN):
        r = put(h.url, "ro", "a.pt", data, token=token, version=v)
        assert r.status == 403 and b"read-only on this hub" in r.data, r.data
    # Nothing was received anywhere, and commit and listing are refused as well.
    assert not (ckpt / INCOMING).exists() or not any((ckpt / INCOMING).iterdir())
    r = pool.request("POST", f"{h.url}/v1/datasets/ckpt/commit", body=b'{"prefix": "a"}',
                     headers={"Authorization": f"Bearer {READER}",
                              "Content-Type": "application/json"})
    assert r.status == 403, r.data
    with pytest.raises(Forbidden):
        Uploader(h.url, "ro", token=OTHER_WRITER).listing()
    # The write token reads its dataset too (a checkpoint is read back by its writer).
    assert "old/step-0.pt" in files_of(h.url, "ckpt", token=WRITER)


@pytest.mark.parametrize("path", ["../outside.pt", "a/../../outside.pt", "%2E%2E/outside.pt",
                                  "a/%2e%2e/%2e%2e/outside.pt", f"{INCOMING}/x.part",
                                  f"{INCOMING}", "x" * 256, "/abs", "a/%00b"])
def test_a_path_that_escapes_or_names_the_hubs_own_folder_is_refused(writable, path) -> None:
    h, ckpt, tmp = writable
    data = b"y" * 10
    # Sent as written (http.client: no client-side clean-up of dot segments).
    u = urllib3.util.parse_url(h.url)
    conn = http.client.HTTPConnection(u.host, u.port, timeout=30)
    try:
        conn.request("PUT", f"/v1/datasets/ckpt/uploads/{path}", data,
                     {H_SIZE: str(len(data)), H_VERSION: version_of(data),
                      "Authorization": f"Bearer {WRITER}"})
        resp = conn.getresponse()
        status, body = resp.status, resp.read()
    finally:
        conn.close()
    # aiohttp resolves some dot segments before routing (then no upload route matches: 404
    # or 405); the rest reach the handler's check (400). Never stored, never 2xx.
    assert status in (400, 404, 405), (path, status, body)
    assert not (tmp / "outside.pt").exists()
    assert not (ckpt / INCOMING).exists() or not any((ckpt / INCOMING).iterdir())


def test_paths_are_cleaned_as_posix_would(writable) -> None:
    """``a//b`` and ``./a/./b`` name ``a/b``, as they would on a local disk."""
    h, _, _ = writable
    data = b"z" * 10
    r = put(h.url, "ckpt", "./n//m/./f.pt", data, version=version_of(data))
    assert r.status == 201 and json.loads(r.data)["path"] == "n/m/f.pt", r.data


def test_bytes_not_the_version_declared_are_dropped_and_never_published(writable) -> None:
    h, ckpt, _ = writable
    data = random.Random(5).randbytes(2 * BLOCK + 3)
    wrong = version_of(data[:-1] + bytes([data[-1] ^ 1]))
    r = put(h.url, "ckpt", "bad.pt", data, version=wrong)
    assert r.status == 422 and b"not " + wrong.encode() in r.data, r.data
    assert metric(h.url, "spokefs_hub_uploads_refused_total", dataset="ckpt",
                  reason="digest_mismatch") == 1
    up = Uploader(h.url, "ckpt", token=WRITER)
    assert up.state("bad.pt") is None  # dropped: sent again from its start
    r = pool.request("POST", f"{h.url}/v1/datasets/ckpt/commit", body=b'{"paths":["bad.pt"]}',
                     headers={"Authorization": f"Bearer {WRITER}",
                              "Content-Type": "application/json"})
    assert r.status == 404, r.data
    assert "bad.pt" not in files_of(h.url, "ckpt") and not (ckpt / "bad.pt").exists()
    # The client maps the answer to DigestMismatch.
    with pytest.raises(DigestMismatch):
        up.client.request("PUT", up._url("bad.pt"), {H_SIZE: str(len(data)), H_VERSION: wrong},
                          body=data)


def test_an_upload_resumes_from_the_bytes_held(writable, tmp_path) -> None:
    h, _, _ = writable
    data = random.Random(7).randbytes(4 * BLOCK + 11)
    v = version_of(data)
    half = len(data) // 2
    r = put(h.url, "ckpt", "big.pt", data[:half], size=len(data), version=v)
    assert r.status == 200 and json.loads(r.data)["received"] == half, r.data
    # Out of step: the hub says what it holds, and keeps it.
    r = put(h.url, "ckpt", "big.pt", data[half + 1:], size=len(data), offset=half + 1,
            version=v)
    assert r.status == 409 and json.loads(r.data)["error"]["received"] == half, r.data
    # A body past the declared size is refused and leaves what was held.
    r = put(h.url, "ckpt", "big.pt", data[half:] + b"extra", size=len(data), offset=half,
            version=v)
    assert r.status == 400, r.data
    up = Uploader(h.url, "ckpt", token=WRITER)
    held = up.state("big.pt")
    assert held is not None and held["received"] == half and not held["whole"]
    # The client sends only the rest.
    src = tmp_path / "big.pt"
    src.write_bytes(data)
    sent = up.put("big.pt", src)
    assert (sent.size, sent.sent, sent.version) == (len(data), len(data) - half, v)
    assert up.put("big.pt", src).sent == 0  # whole already: nothing sent
    # A new version of the same path replaces an upload not yet committed, from offset 0.
    other = data[::-1]
    src.write_bytes(other)
    assert up.put("big.pt", src).sent == len(other)
    up.commit(paths=["big.pt"])
    e = files_of(h.url, "ckpt")["big.pt"]
    assert e["version"] == version_of(other)
    assert read_back(h.url, "ckpt", e["version"], len(other)) == other


def test_a_commit_is_all_or_nothing_and_a_published_path_is_never_replaced(writable, tmp_path
                                                                           ) -> None:
    h, ckpt, _ = writable
    up = Uploader(h.url, "ckpt", token=WRITER)
    whole = b"w" * 1000
    (tmp_path / "w").write_bytes(whole)
    up.put("s/whole.pt", tmp_path / "w")
    data = b"p" * 1000
    assert put(h.url, "ckpt", "s/part.pt", data[:10], size=len(data),
               version=version_of(data)).status == 200
    with pytest.raises(Conflict, match="not received whole"):
        up.commit(prefix="s/")
    assert not [p for p in files_of(h.url, "ckpt") if p.startswith("s/")]
    assert not (ckpt / "s").exists()
    # A path the folder has: a writable dataset only grows.
    (tmp_path / "o").write_bytes(b"replacement")
    up.put("old/step-0.pt", tmp_path / "o")
    with pytest.raises(Conflict, match="exists in the dataset already"):
        up.commit(paths=["old/step-0.pt", "s/whole.pt"])
    assert (ckpt / "old" / "step-0.pt").read_bytes() == b"the first checkpoint\n"
    assert "s/whole.pt" not in files_of(h.url, "ckpt")
    # "a" and "a/b" cannot both be files.
    up.put("s/whole.pt/inner", tmp_path / "w")
    with pytest.raises(Conflict, match="a file and a folder"):
        up.commit(paths=["s/whole.pt", "s/whole.pt/inner"])
    up.discard("s/whole.pt/inner")
    up.discard("old/step-0.pt")
    doc = up.commit(paths=["s/whole.pt"])
    assert doc["committed"] == ["s/whole.pt"]
    assert files_of(h.url, "ckpt")["s/whole.pt"]["version"] == version_of(whole)
    # The status shows the dataset writable, and the upload still under way.
    r = pool.request("GET", f"{h.url}/v1/status", headers={"Authorization": f"Bearer {ADMIN}"})
    st = {d["name"]: d for d in json.loads(r.data)["datasets"]}
    assert st["ckpt"]["writable"] and st["ckpt"]["uploads"]["files"] == 1
    assert "writable" not in st["ro"]


def test_an_upload_that_cannot_fit_is_refused_before_a_byte_is_kept(writable) -> None:
    h, ckpt, _ = writable
    free = os.statvfs(ckpt)
    size = free.f_bavail * free.f_frsize + (1 << 30)
    r = put(h.url, "ckpt", "huge.pt", b"", size=size, version="0" * 32)
    assert r.status == 507 and b"no room on the hub" in r.data, r.data
    assert Uploader(h.url, "ckpt", token=WRITER).state("huge.pt") is None


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _received(inc: Incoming, files: dict[str, bytes]) -> None:
    """``files`` received whole by ``inc`` (in this process: the hub's own code, no HTTP)."""
    for path, data in files.items():
        asyncio.run(inc.receive(path, len(data), version_of(data), 0, _once(data)))


def _held(inc: Incoming, path: str) -> Upload:
    return next(u for u in (inc._meta(m.stem) for m in inc.dir.glob("*.json"))
                if u is not None and u.path == path)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[tuple[HubState, Incoming, Path]]:
    root = tmp_path / "ds"
    root.mkdir()
    st = HubState(root, tmp_path / "state", "ds", BLOCK, writable=True).open()
    assert st.uploads is not None
    try:
        yield st, st.uploads, root
    finally:
        st.close()


@pytest.mark.parametrize("crash", ["one linked", "all linked, one part gone"])
def test_a_commit_a_crash_left_is_finished_by_the_next_scan(tmp_path: Path, crash: str
                                                            ) -> None:
    """The journal is durable before the first link: a hub killed between links, or after
    them while the parts go, publishes all of the commit's files on its next scan, with
    the digests it made."""
    root = tmp_path / "ds"
    root.mkdir()
    st = HubState(root, tmp_path / "state", "ds", BLOCK, writable=True).open()
    first = st.scan().snapshot.id
    inc = st.uploads
    assert inc is not None
    rng = random.Random(11)
    files = {"c/a.pt": rng.randbytes(BLOCK + 1), "c/b.pt": rng.randbytes(10)}
    _received(inc, files)
    journal, chosen = inc.prepare(None, "c/")
    assert sorted(chosen) == sorted(files)
    # The crash, as place() leaves things at that point, then the process gone before the
    # scan recorded anything.
    inc._link(_held(inc, "c/a.pt"))
    if crash != "one linked":
        inc._link(_held(inc, "c/b.pt"))
        os.unlink(inc.dir / f"{_key('c/a.pt')}.part")
    st.close()
    assert journal.exists()

    again = HubState(root, tmp_path / "state", "ds", BLOCK, writable=True).open()
    try:
        assert again.resolve("latest").id == first  # nothing published yet
        result = again.scan()
        # Both recorded with the digests made as they came in: the one placed before the
        # crash too (it is still the file that was checked).
        assert result.created_new and result.files_hashed == 0
        m = Manifest.decode(again.manifest_path(result.snapshot.id).read_bytes())
        got = dict(zip(m.paths, m.versions, strict=True))
        assert got == {p: version_of(d) for p, d in files.items()}
        assert not journal.exists() and not any(inc.dir.iterdir())
        for path, data in files.items():
            assert (root / path).read_bytes() == data
    finally:
        again.close()


@pytest.mark.parametrize("change", ["a file took a path", "an upload was rewritten"])
def test_a_commit_the_folder_changed_under_publishes_nothing_and_keeps_its_uploads(
        ledger, change: str) -> None:
    """Between the journal and the links, a local user writes into the hub's folder: the
    commit is all or nothing, so none of its files is published, its journal is set aside
    with the reason, and its uploads stay to be committed again."""
    st, inc, root = ledger
    files = {"c/a.pt": b"a" * 100, "c/b.pt": b"b" * 100}
    _received(inc, files)
    journal, _ = inc.prepare(None, "c/")
    if change == "a file took a path":
        (root / "c").mkdir()
        (root / "c" / "b.pt").write_bytes(b"by hand\n")
    else:
        with open(inc.dir / f"{_key('c/b.pt')}.part", "r+b") as f:
            f.write(b"B")
    result = st.scan()
    m = Manifest.decode(st.manifest_path(result.snapshot.id).read_bytes())
    assert "c/a.pt" not in m.paths and not (root / "c" / "a.pt").exists()
    assert not journal.exists()
    aside = json.loads((journal.parent / "failed" / journal.name).read_bytes())
    assert "c/b.pt" in aside["error"]
    held = {u["path"]: u for u in inc.listing()}
    assert held.keys() == files.keys()
    assert all(u["whole"] and not u["committing"] for u in held.values())
    # What is still as it was checked commits now.
    _, chosen = st.commit(["c/a.pt"], None)
    assert chosen == ["c/a.pt"] and (root / "c" / "a.pt").read_bytes() == files["c/a.pt"]


def test_a_link_the_filesystem_refuses_fails_that_commit_alone(ledger) -> None:
    """A lasting error on one commit's way (here an immutable folder: EPERM even for root)
    answers that commit with the reason and undoes the links it made; later scans and
    commits go on, and the same commit lands once the cause is gone."""
    st, inc, root = ledger
    (root / "x").mkdir()
    if subprocess.run(["chattr", "+i", str(root / "x")], capture_output=True).returncode:
        pytest.skip("this filesystem has no immutable flag (chattr +i)")
    try:
        files = {"a/first.pt": b"1" * 10, "x/locked.pt": b"2" * 10, "y/other.pt": b"3" * 10}
        _received(inc, files)
        with pytest.raises(Conflict, match=r"nothing was published.*Operation not permitted"):
            st.commit(["a/first.pt", "x/locked.pt"], None)
        assert not (root / "a" / "first.pt").exists()  # linked first, then undone
        _, chosen = st.commit(["y/other.pt"], None)
        assert chosen == ["y/other.pt"]
        assert st.scan().snapshot.id == st.resolve("latest").id
    finally:
        subprocess.run(["chattr", "-i", str(root / "x")], check=True)
    _, chosen = st.commit(None, "")
    assert sorted(chosen) == ["a/first.pt", "x/locked.pt"]
    for path, data in files.items():
        assert (root / path).read_bytes() == data


def test_an_upload_being_committed_is_not_received_again_or_discarded(ledger) -> None:
    st, inc, root = ledger
    _received(inc, {"c/a.pt": b"a" * 100})
    inc.prepare(["c/a.pt"], None)  # journalled: the next scan publishes it
    assert inc.listing()[0]["committing"]
    other = b"z" * 100
    with pytest.raises(Conflict, match="being committed"):
        asyncio.run(inc.receive("c/a.pt", len(other), version_of(other), 0, _once(other)))
    with pytest.raises(Conflict, match="being committed"):
        inc.discard("c/a.pt")
    with pytest.raises(Conflict, match="being committed already"):
        inc.prepare(["c/a.pt"], None)
    st.scan()
    assert inc.listing() == [] and (root / "c" / "a.pt").read_bytes() == b"a" * 100


def test_a_commit_whose_answer_was_lost_is_found_landed_not_sent_twice(writable, tmp_path
                                                                       ) -> None:
    """The hub commits, and the connection drops before its answer: the writer asks what
    became of it instead of resending (a resend would find the uploads gone: 404)."""
    h, ckpt, _ = writable
    host, port = h.hostport.split(":")
    up = Uploader(h.url, "ckpt", token=WRITER)
    for name in ("a.pt", "b.pt"):
        src = tmp_path / name
        src.write_bytes(name.encode() * 1000)
        up.put(f"lost/{name}", src)
    proxy = CuttingProxy((host, int(port)), on=b"POST /v1/datasets/ckpt/commit")
    with proxy.running() as pport:
        doc = Uploader(f"http://127.0.0.1:{pport}", "ckpt", token=WRITER,
                       deadline=10).commit(prefix="lost/")
    assert proxy.done, "the proxy did not cut the answer"
    assert doc["recovered"] and sorted(doc["committed"]) == ["lost/a.pt", "lost/b.pt"]
    assert sum(r.startswith(b"POST") for r in proxy.requests) == 1
    assert doc["id"] == Client(h.url, token=READER).resolve("ckpt", "latest")
    assert (ckpt / "lost" / "a.pt").read_bytes() == b"a.pt" * 1000


def test_writable_is_a_folders_setting(tmp_path: Path) -> None:
    file = tmp_path / "hub.toml"
    [spec] = parse_datasets({"datasets": {"c": {"source": "/x", "writable": True}}}, file,
                            1 << 20, None, None)
    assert spec.writable
    with pytest.raises(ConfigError, match="writable datasets are folders"):
        parse_datasets({"datasets": {"c": {"source": "s3://b/p", "writable": True}}}, file,
                       1 << 20, None, None)
    with pytest.raises(ConfigError, match="writable must be true or false"):
        parse_datasets({"datasets": {"c": {"source": "/x", "writable": "yes"}}}, file,
                       1 << 20, None, None)
    # A --writable naming no dataset fails at start, saying which.
    p = ServerProcess("hub", "serve", str(tmp_path), "--port", "0", "--writable", "nope",
                      "--state-dir", str(tmp_path / "st"))
    with pytest.raises(StartError, match="--writable nope: no dataset 'nope'"):
        p.start()


def test_file_version_matches_the_hubs_digest(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(3 * BLOCK)
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f:
        assert file_version(f, BLOCK) == (len(data), version_of(data))


def test_a_body_cut_short_keeps_what_arrived_and_resumes_from_it(writable, tmp_path) -> None:
    """A writer gone midway (a killed process, a broken link): what the hub had read of the
    body is flushed and counted, and the writer's next put sends only the rest. (The tail
    still in socket buffers when the connection dropped is lost; aiohttp drops what it
    buffered too, so only "some, and no more than was sent" can be asserted.)"""
    h, _, _ = writable
    data = random.Random(13).randbytes(20 << 20)
    cut = 16 << 20  # past several of the hub's gathered writes (WRITE_CHUNK)
    u = urllib3.util.parse_url(h.url)
    with socket.create_connection((u.host, u.port), timeout=30) as sock:
        head = (f"PUT /v1/datasets/ckpt/uploads/cut.pt HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {WRITER}\r\n{H_SIZE}: {len(data)}\r\n"
                f"{H_VERSION}: {version_of(data)}\r\nContent-Length: {len(data)}\r\n\r\n")
        sock.sendall(head.encode() + data[:cut])
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1 << 16) == b""  # the hub drops the connection: no answer
    up = Uploader(h.url, "ckpt", token=WRITER)
    held = up.state("cut.pt")
    assert held is not None and 0 < held["received"] <= cut and not held["whole"], held
    src = tmp_path / "cut.pt"
    src.write_bytes(data)
    # Only the rest is sent (the hub may still be flushing the cut body's tail: the put
    # then finds more held, or waits for the first receive to end).
    assert up.put("cut.pt", src).sent <= len(data) - held["received"]
    up.commit(paths=["cut.pt"])
    e = files_of(h.url, "ckpt")["cut.pt"]
    assert read_back(h.url, "ckpt", e["version"], len(data)) == data


def test_ckpt_push_uploads_a_folder_and_publishes_it(writable, tmp_path) -> None:
    """The CLI, as a user runs it: push (resumed when run again), uploads, commit."""
    h, ckpt, _ = writable
    local = tmp_path / "step-7"
    (local / "sub").mkdir(parents=True)
    (local / "model.pt").write_bytes(random.Random(2).randbytes(2 * BLOCK + 9))
    (local / "sub" / ".metadata").write_bytes(b"meta")
    env = {**os.environ, "SPOKEFS_TOKEN": WRITER}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "spokefs.cli", "ckpt", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    r = cli("push", str(local), f"{h.url}/ckpt/runs/step-7", "--no-commit")
    assert r.returncode == 0 and "uploaded 2 files" in r.stdout, r.stderr
    r = cli("uploads", f"{h.url}/ckpt/runs")
    assert r.returncode == 0 and "runs/step-7/model.pt" in r.stdout, r.stderr
    assert not (ckpt / "runs").exists()
    r = cli("push", str(local), f"{h.url}/ckpt/runs/step-7")  # again: nothing sent, committed
    assert r.returncode == 0 and "(0 sent now" in r.stdout and "published 2 files" in r.stdout
    assert (ckpt / "runs/step-7/sub/.metadata").read_bytes() == b"meta"
    assert sorted(p for p in files_of(h.url, "ckpt") if p.startswith("runs/")) == [
        "runs/step-7/model.pt", "runs/step-7/sub/.metadata"]
    # A reader's token is refused with the reason, and exits 2.
    env["SPOKEFS_TOKEN"] = READER
    r = cli("push", str(local), f"{h.url}/ckpt/runs/step-8")
    assert r.returncode == 2 and "may not write dataset 'ckpt'" in r.stderr, r.stderr
    r = cli("commit", f"{h.url}/ckpt")
    assert r.returncode == 2 and "name the folder to commit" in r.stderr, r.stderr


def test_an_upload_abandoned_for_a_week_is_dropped_by_the_next_scan(tmp_path: Path) -> None:
    st = HubState(tmp_path / "ds", tmp_path / "state", "ds", BLOCK, writable=True)
    (tmp_path / "ds").mkdir()
    st.open()
    try:
        inc = st.uploads
        assert inc is not None

        async def body(data: bytes) -> AsyncIterator[bytes]:
            yield data

        data = b"q" * 100
        for path in ("old.pt", "new.pt"):
            asyncio.run(inc.receive(path, len(data), version_of(data), 0, body(data[:50])))
        week_ago = time.time() - 8 * 86400
        old_key = next(m.stem for m in inc.dir.glob("*.json")
                       if json.loads(m.read_bytes())["path"] == "old.pt")
        for sfx in (".json", ".part"):
            os.utime(inc.dir / f"{old_key}{sfx}", (week_ago, week_ago))
        st.scan()
        assert [u["path"] for u in inc.listing()] == ["new.pt"]
        assert inc.state("new.pt")["received"] == 50
    finally:
        st.close()


async def _pieces(data: bytes, seed: int) -> AsyncIterator[bytes]:
    """``data`` in pieces of odd sizes, as a socket hands a body over."""
    rng, at = random.Random(seed), 0
    while at < len(data):
        n = rng.choice([1, 4095, 4097, 65536, 300_001, 5 << 20])
        yield data[at:at + n]
        at += n


def _resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (util-linux's fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip())


def test_a_body_is_written_past_the_page_cache_and_checked_as_it_arrives(tmp_path) -> None:
    """A large upload is written with direct I/O from one aligned buffer: it leaves (almost)
    nothing in the page cache, however its body is cut into pieces; its digests are made on
    arrival and equal a read-back's; a resume at an offset off every boundary, and a body
    not its declared version, are checked as before."""
    probe = tmp_path / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this filesystem offers no direct I/O")
    (tmp_path / "ds").mkdir()
    inc = Incoming(tmp_path / "ds", tmp_path / "state", BLOCK)
    data = random.Random(3).randbytes((18 << 20) + 12_345)
    v = version_of(data)

    done = asyncio.run(inc.receive("a.pt", len(data), v, 0, _pieces(data, 1)))
    assert done["whole"] and done["received"] == len(data)
    part = inc.dir / f"{_key('a.pt')}.part"
    assert part.read_bytes() == data
    with open(part, "rb") as f:
        assert inc.upload("a.pt").digests == b"".join(integrity.stream_digests(f, BLOCK)[1])
    os.posix_fadvise(os.open(part, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)

    # Received in two requests, the second from an odd offset (written through the page
    # cache up to the next 4 KiB boundary, then directly again).
    cut = 7 * BLOCK + 4097
    first = asyncio.run(inc.receive("b.pt", len(data), v, 0, _pieces(data[:cut], 2)))
    assert first == {**first, "received": cut, "whole": False}
    done = asyncio.run(inc.receive("b.pt", len(data), v, cut, _pieces(data[cut:], 3)))
    assert done["whole"]
    part_b = inc.dir / f"{_key('b.pt')}.part"
    assert part_b.read_bytes() == data
    fd = os.open(part_b, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

    # What stays cached of a fresh 18 MiB upload: its short tail, not its body.
    done = asyncio.run(inc.receive("c.pt", len(data), v, 0, _pieces(data, 4)))
    assert done["whole"]
    assert _resident(inc.dir / f"{_key('c.pt')}.part") <= 64 * 1024

    # Digested on arrival, a body that is not its declared version is dropped.
    bad = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(DigestMismatch):
        asyncio.run(inc.receive("d.pt", len(bad), v, 0, _pieces(bad, 5)))
    assert inc.upload("d.pt") is None
    # And so is one resumed (checked by reading the part back).
    asyncio.run(inc.receive("e.pt", len(bad), v, 0, _pieces(bad[:cut], 6)))
    with pytest.raises(DigestMismatch):
        asyncio.run(inc.receive("e.pt", len(bad), v, cut, _pieces(bad[cut:], 7)))
    assert inc.upload("e.pt") is None


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK])
def test_digests_made_in_pieces_are_a_whole_files(tmp_path: Path, size: int) -> None:
    data = random.Random(size).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f:
        whole = integrity.stream_digests(f, BLOCK)[1]
    for step in (1000, BLOCK, 3 * BLOCK):
        d = integrity.BlockDigests(BLOCK)
        for i in range(0, size, step):
            d.update(data[i:i + step])
        assert d.digests() == whole


def test_a_direct_reader_reads_every_span_exactly_and_past_the_page_cache(tmp_path) -> None:
    """``DirectReader`` (an upload's part read on to the hub or into the cache): any offset
    and length, the file's end included, as a plain read gives them, and none of it left
    in the page cache where the filesystem offers direct I/O."""
    from spokefs.cache.durable import DirectReader

    data = random.Random(9).randbytes((9 << 20) + 777)
    path = tmp_path / "part"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    f = DirectReader(path, 1 << 20)
    try:
        spans = [(0, 1 << 20), (1, 4095), (4095, 2), (4096 * 3, 1 << 20), (12_345, 1 << 20),
                 (len(data) - 10, 1 << 20), (len(data) - 4096, 4096), (len(data), 100),
                 (len(data) + 5000, 10)]
        for at, n in spans:
            assert f.read(at, n) == data[at:at + n], (at, n)
        at, got = 0, []
        while piece := f.read(at, 1 << 20):  # a whole pass, as the upload reads it
            got.append(piece)
            at += len(piece)
        assert b"".join(got) == data
        direct = f.dfd is not None
    finally:
        f.close()
    if direct:
        assert _resident(path) <= 64 * 1024
