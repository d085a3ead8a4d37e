"""Write-back through a spoke (spoke/writeback.py): files written to a spoke are answered once
durable there, uploaded to the hub behind, and published by the hub when their commit comes
through, whole or not at all; a hub that is down, or a spoke killed meanwhile, loses nothing.
Real hub and spoke processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, free_port, hub, spoke
from spokefs.client.sync import Client
from spokefs.client.uploads import Uploader
from spokefs.errors import Conflict, Forbidden, NoSpace
from spokefs.wire.headers import H_SIZE, H_VERSION

BLOCK = 64 * 1024
WRITER = "writer-" + "w" * 32      # write:ckpt,ro at the spoke (ro: read-only at the hub)
READER = "reader-" + "r" * 32      # read:ckpt,ro
UPSTREAM = "spokeup-" + "u" * 32   # the spoke's own token at the hub: write:ckpt,ro


class Site:
    """A hub on a fixed port (to stop and start again) and a spoke in front of it."""

    def __init__(self, tmp: Path, *spoke_args: str) -> None:
        self.tmp = tmp
        self.ckpt = tmp / "ckpt"
        self.ckpt.mkdir()
        (self.ckpt / "old.pt").write_bytes(b"before\n")
        ro = tmp / "ro"
        ro.mkdir()
        (ro / "a.txt").write_text("read only\n")
        readers = f"r read:ckpt,ro {READER}\n"
        (tmp / "hub.tokens").write_text(f"spoke write:ckpt,ro {UPSTREAM}\n{readers}")
        (tmp / "spoke.tokens").write_text(f"w write:ckpt,ro {WRITER}\n{readers}")
        (tmp / "up.token").write_text(UPSTREAM + "\n")
        self.port = free_port()
        self.ro = ro
        self.spoke_args = spoke_args
        self.hub: ServerProcess | None = None
        self.spoke: ServerProcess | None = None

    def start_hub(self) -> ServerProcess:
        self.hub = hub(self.ckpt, self.tmp / "state", "--block-size", str(BLOCK),
                       "--dataset", f"ro={self.ro}", "--writable", "ckpt",
                       "--auth", str(self.tmp / "hub.tokens"), "--port", str(self.port))
        return self.hub.start()

    def start_spoke(self) -> ServerProcess:
        self.spoke = spoke(f"http://127.0.0.1:{self.port}", self.tmp / "cache", "1GiB",
                           "--auth", str(self.tmp / "spoke.tokens"), "--upstream-token-file",
                           str(self.tmp / "up.token"), "--workers", "1", *self.spoke_args)
        return self.spoke.start()

    def writer(self) -> Uploader:
        assert self.spoke is not None
        return Uploader(self.spoke.url, "ckpt", token=WRITER, deadline=10)

    def close(self) -> None:
        for proc in (self.spoke, self.hub):
            if proc is not None:
                proc.stop()


@pytest.fixture(name="site")
def site_fixture(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    s.start_hub()
    s.start_spoke()
    try:
        yield s
    finally:
        s.close()


def _files(tmp: Path, n: int, size: int) -> dict[str, Path]:
    out = {}
    for i in range(n):
        p = tmp / f"rank{i}.distcp"
        p.write_bytes(os.urandom(size))
        out[f"step-1/rank{i}.distcp"] = p
    return out


def handoffs(site: Site) -> float:
    """Files the spoke took by descriptor (spoke/handoff.py), not over HTTP."""
    assert site.spoke is not None
    text = urllib3.request("GET", f"{site.spoke.url}/metrics",
                           headers={"Authorization": f"Bearer {WRITER}"}).data.decode()
    line = next(x for x in text.splitlines()
                if x.startswith("spokefs_writeback_handoff_files_total "))
    return float(line.split()[1])


def _published(site: Site) -> dict[str, str]:
    m = Client(f"http://127.0.0.1:{site.port}", token=READER).manifest("ckpt", "latest")
    return dict(zip(m.paths, m.versions, strict=True))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_commit_at_the_spoke_is_published_at_the_hub_whole(tmp_path: Path, workers: str
                                                              ) -> None:
    """Through either worker (a replica streams a PUT's body on to the primary)."""
    site = Site(tmp_path, "--workers", workers)
    site.start_hub()
    site.start_spoke()
    try:
        _written_back(site, tmp_path)
    finally:
        site.close()


def _written_back(site: Site, tmp_path: Path) -> None:
    up = site.writer()
    files = _files(tmp_path, 3, BLOCK * 2 + 17)
    sent = {path: up.put(path, local) for path, local in files.items()}
    doc = up.commit(prefix="step-1/")
    assert doc["safe"] is False and sorted(doc["committed"]) == sorted(files)
    assert up.wait_safe("step-1/", timeout=60)
    published = _published(site)
    assert {p: published.get(p) for p in files} == {p: s.version for p, s in sent.items()}
    assert site.writer().writeback()["unsafe_bytes"] == 0
    # A reader of the spoke gets the new snapshot's bytes (by its id: a replica worker
    # trusts the "latest" it knew for --latest-ttl).
    snap = Client(f"http://127.0.0.1:{site.port}", token=READER).resolve("ckpt", "latest")
    reader = Client(site.spoke.url, token=READER)  # type: ignore[union-attr]
    m = reader.manifest("ckpt", snap)
    for path, local in files.items():
        version = m.versions[m.paths.index(path)]
        assert reader.read("ckpt", version, 0, local.stat().st_size) == local.read_bytes()


def test_a_published_commit_stays_in_the_spokes_cache(site: Site, tmp_path: Path) -> None:
    """Once published, a commit written through the spoke is read back from the spoke's own
    cache (spoke.kept): with the hub gone, and after the spoke is stopped and started again
    (stopped, not killed: the index commits its last 50 ms of writes behind, and a kill -9
    may take them, the dataset's newest state among them; the chaos tests cover kills)."""
    up = site.writer()
    files = _files(tmp_path, 2, BLOCK * 3 + 11)
    for path, local in files.items():
        up.put(path, local)
    up.commit(prefix="step-1/")
    assert up.wait_safe("step-1/", timeout=60)
    assert site.spoke is not None and site.hub is not None
    reader = Client(site.spoke.url, token=READER)
    snap = reader.resolve("ckpt", "latest")
    m = reader.manifest("ckpt", snap)  # the manifest, kept by the spoke
    metrics = urllib3.request("GET", f"{site.spoke.url}/metrics",
                              headers={"Authorization": f"Bearer {WRITER}"}).data.decode()
    size = sum(p.stat().st_size for p in files.values())
    assert f"spokefs_writeback_cached_bytes_total {size}.0" in metrics
    assert f"spokefs_writeback_pinned_bytes {size}.0" in metrics
    site.hub.stop()
    for restarted in (False, True):
        if restarted:
            site.spoke.stop()
            site.start_spoke()
            reader = Client(site.spoke.url, token=READER)
            assert reader.manifest("ckpt", snap).paths == m.paths  # by its id, as kept
        for path, local in files.items():
            version = m.versions[m.paths.index(path)]
            got = reader.read("ckpt", version, 0, local.stat().st_size)
            assert got == local.read_bytes(), (path, restarted)


def test_the_hub_down_and_the_spoke_killed_lose_nothing(site: Site, tmp_path) -> None:
    """Written and committed while the hub is down, the spoke killed -9, started again, the
    hub back: the commit is published whole, and ``ckpt wait`` returns."""
    up = site.writer()
    _ = up.block_size  # the spoke learns the dataset while the hub is up
    assert site.hub is not None and site.spoke is not None
    site.hub.stop()
    files = _files(tmp_path, 2, BLOCK + 5)
    for path, local in files.items():
        up.put(path, local)
    up.commit(prefix="step-1/")
    doc = up.writeback()
    assert [c["files"] for c in doc["commits"]] == [2] and doc["unsafe_bytes"] > 0
    metrics = urllib3.request("GET", f"{site.spoke.url}/metrics",
                              headers={"Authorization": f"Bearer {WRITER}"}).data.decode()
    assert f'spokefs_writeback_unsafe_bytes{{dataset="ckpt"}} {doc["unsafe_bytes"]}.0' in metrics
    assert 'spokefs_writeback_commits_waiting{dataset="ckpt"} 1.0' in metrics
    site.spoke.kill()
    site.start_spoke()
    assert site.writer().writeback()["commits"], "the commit did not survive the kill"
    # What the spoke answered for stays guarded after its restart: no rewrite, no discard.
    first = next(iter(files))
    r = urllib3.request("PUT", f"{site.spoke.url}/v1/datasets/ckpt/uploads/{first}",
                        body=b"x", headers={"Authorization": f"Bearer {WRITER}", H_SIZE: "1",
                                            H_VERSION: "0" * 32})
    assert r.status == 409 and b"being committed" in r.data, r.data
    site.start_hub()
    env = {**os.environ, "SPOKEFS_TOKEN": WRITER}
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "ckpt", "wait",
                        f"{site.spoke.url}/ckpt/step-1", "--timeout", "60"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    published = _published(site)
    for path, local in files.items():
        assert path in published
        assert (site.ckpt / path).read_bytes() == local.read_bytes()


def test_unsafe_bytes_past_the_quota_are_refused_and_kept(tmp_path: Path) -> None:
    site = Site(tmp_path, "--unsafe-quota", "1000")
    site.start_hub()
    site.start_spoke()
    try:
        up = site.writer()
        _ = up.block_size
        assert site.hub is not None
        site.hub.stop()  # nothing can leave the spoke
        a, b = tmp_path / "a", tmp_path / "b"
        a.write_bytes(b"a" * 800)
        b.write_bytes(b"b" * 800)
        up.put("a.pt", a)
        with pytest.raises(NoSpace, match="quota of 1000"):
            up.put("b.pt", b)
        assert [u["path"] for u in up.listing()] == ["a.pt"]  # what was acknowledged stays
        site.start_hub()
        up.commit(paths=["a.pt"])
        assert up.wait_safe("", timeout=60)
        up.put("b.pt", b)  # room again once the hub took it
    finally:
        site.close()


def test_a_commit_the_hub_would_refuse_is_refused_at_once(site: Site, tmp_path) -> None:
    """A path the hub's dataset has (``old.pt``), or one under a file of it: 409 from the
    spoke, before anything is journalled, not 202 and a failure later."""
    f = tmp_path / "x"
    f.write_bytes(b"new bytes\n")
    up = site.writer()
    for path, why in (("old.pt", "exists in the dataset at the hub"),
                      ("old.pt/inner", "is a file in the dataset at the hub")):
        up.put(path, f)
        with pytest.raises(Conflict, match=why):
            up.commit(paths=[path])
    doc = up.writeback()
    assert doc["commits"] == [] and doc["failed"] == []
    assert sorted(u["path"] for u in doc["uploads"]) == ["old.pt", "old.pt/inner"]
    assert (site.ckpt / "old.pt").read_bytes() == b"before\n"


def test_a_read_only_dataset_takes_no_writes_at_the_spoke(site: Site, tmp_path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"x")
    assert site.spoke is not None
    with pytest.raises(Forbidden, match="read-only"):  # the writer asks first
        Uploader(site.spoke.url, "ro", token=WRITER).put("x", f)
    r = urllib3.request("PUT", f"{site.spoke.url}/v1/datasets/ro/uploads/x", body=b"x",
                        headers={"Authorization": f"Bearer {WRITER}", H_SIZE: "1",
                                 H_VERSION: "0" * 32})
    assert r.status == 403 and b"read-only at its hub" in r.data, r.data  # and the spoke
    with pytest.raises(Forbidden):  # a reader's token may not write
        Uploader(site.spoke.url, "ckpt", token=READER).put("x", f)


def test_spokefs_open_wb_writes_through_the_spoke(site: Site, tmp_path, monkeypatch) -> None:
    """``spokefs.open(URL, "wb")``: staged locally, uploaded on close, published as a commit
    of its own; an upload refused at close raises there and keeps the staged bytes."""
    import spokefs

    assert site.spoke is not None
    monkeypatch.setenv("SPOKEFS_TOKEN", WRITER)
    monkeypatch.setenv("SPOKEFS_STAGING", str(tmp_path))
    data = os.urandom(BLOCK * 3 + 1)
    with spokefs.open(f"{site.spoke.url}/ckpt/notes/model.pt", "wb") as f:
        f.write(data[:100])
        f.write(data[100:])
    assert site.writer().wait_safe("notes/model.pt", timeout=60)  # a file, or a folder
    assert (site.ckpt / "notes" / "model.pt").read_bytes() == data
    # A writer that fails inside its with-block sends nothing: half a file is not the file.
    with pytest.raises(RuntimeError), \
            spokefs.open(f"{site.spoke.url}/ckpt/notes/half.pt", "wb") as f:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    assert "notes/half.pt" not in {u["path"] for u in site.writer().listing()}
    with spokefs.open(f"{site.spoke.url}/ckpt/notes/log.txt", "w") as t:
        t.write("step 1\n")
    assert site.writer().wait_safe("notes/", timeout=60)
    assert (site.ckpt / "notes" / "log.txt").read_text() == "step 1\n"
    assert not list(tmp_path.glob("spokefs-*.part"))  # nothing staged is left behind
    with pytest.raises(Forbidden, match="read-only"):  # at open: nothing to lose yet
        spokefs.open(f"{site.spoke.url}/ro/x.pt", "wb")
    monkeypatch.setenv("SPOKEFS_TOKEN", READER)  # may read the dataset, not write it
    g = spokefs.open(f"{site.spoke.url}/ckpt/x.pt", "wb", buffering=0)
    g.write(b"kept")
    with pytest.raises(Forbidden) as caught:
        g.close()
    [staged] = tmp_path.glob("spokefs-*.part")
    assert staged.read_bytes() == b"kept" and str(staged) in "".join(caught.value.__notes__)


def test_a_commit_is_safe_before_its_files_are_kept_and_recorded_once_across_a_kill(
        site: Site, tmp_path: Path) -> None:
    """The hub's publishing is recorded (``ckpt wait`` returns on it) before the spoke reads
    the commit's files into its cache (spoke.kept), which can take a while for a large one:
    the spoke is killed -9 the moment the record is on disk, and the commit's journal is
    still there then (it goes once the files are kept). Started again, the spoke finds the
    commit landed at the hub and finishes it without recording it a second time."""
    assert site.spoke is not None
    up = site.writer()
    files = _files(tmp_path, 4, 16 << 20)
    for path, local in files.items():
        up.put(path, local)
    wb = tmp_path / "cache" / "writeback" / "ckpt"
    commit = up.commit(prefix="step-1/")["commit"]
    deadline = time.monotonic() + 60
    while commit not in _recorded(wb):
        assert time.monotonic() < deadline, "the commit was not published within 60 s"
        time.sleep(0.002)
    site.spoke.kill()
    assert (wb / "commits" / f"{commit}.json").exists(), \
        "the commit's local copies went before its record: was it kept first?"
    site.start_spoke()
    ok = site.writer().wait_safe("step-1/", timeout=60)
    assert ok, "".join(site.spoke.output()[-30:])
    deadline = time.monotonic() + 60
    while (wb / "commits" / f"{commit}.json").exists():  # finished: kept, then retired
        assert time.monotonic() < deadline, "the commit was not finished after the restart"
        time.sleep(0.05)
    assert _recorded(wb).count(commit) == 1
    published = _published(site)
    assert all(path in published for path in files)
    reader = Client(site.spoke.url, token=READER)  # type: ignore[union-attr]
    m = reader.manifest("ckpt", reader.resolve("ckpt", "latest"))
    for path, local in files.items():
        version = m.versions[m.paths.index(path)]
        assert reader.read("ckpt", version, 0, local.stat().st_size) == local.read_bytes()


def _recorded(wb: Path) -> list[str]:
    """The commits ``done.jsonl`` records as published, in order."""
    try:
        lines = (wb / "done.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["commit"] for line in lines if line.endswith("}")]
