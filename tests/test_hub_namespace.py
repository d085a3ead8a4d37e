"""A hub's namespace: datasets from --dataset and from [datasets.NAME] of --config, folders
and buckets in one hub, added and removed while readers read the others; state folders
written before the one ledger open as they were."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, make_dataset, output_with, spoke
from spokefs.errors import ConfigError
from spokefs.hub.bucket import BucketState
from spokefs.hub.namespace import parse_datasets
from spokefs.hub.snapshot import HubState
from spokefs.origin.base import ObjectStoreOrigin, parse_store_url

http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=30))


def names(base: str) -> list[str]:
    r = http.request("GET", f"{base}/v1/datasets")
    assert r.status == 200, r.data
    return [d["name"] for d in json.loads(r.data)["datasets"]]


def until(what: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``what`` until it holds, or fail at the deadline."""
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "not reached before the deadline"
        time.sleep(0.05)


def config_hub(config: Path, state: Path, *extra: str) -> ServerProcess:
    return ServerProcess("hub", "serve", "--config", str(config), "--port", "0",
                         "--state-dir", str(state), *extra)


def small(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "f.txt").write_text(text)
    return root


# -- the config's tables -----------------------------------------------------------------------
def test_dataset_tables_bad_keys_name_file_table_and_key(tmp_path: Path) -> None:
    file = tmp_path / "hub.toml"
    ok = parse_datasets({"datasets": {"a": {"source": "/x", "block-size": "1MiB"},
                                      "b": {"source": "s3://bkt/p", "endpoint": "http://e"}}},
                        file, 4 << 20, str(tmp_path / "st"), None)
    assert [(s.name, s.block_size, s.state_dir, s.endpoint) for s in ok] == [
        ("a", 1 << 20, f"{tmp_path}/st/a", None), ("b", 4 << 20, f"{tmp_path}/st/b", "http://e")]
    for table, why in [({"sorce": "/x"}, "'sorce' is not a dataset setting"),
                       ({}, "'source' is missing"),
                       ({"source": "/x", "block_size": "big"}, "block_size='big'"),
                       ({"source": 3}, "source must be a non-empty string")]:
        with pytest.raises(ConfigError, match=why) as info:
            parse_datasets({"datasets": {"a": table}}, file, 1, None, None)
        assert f"{file} [datasets.a]" in str(info.value)
    with pytest.raises(ConfigError, match=r"\[datasets.a/b\]"):
        parse_datasets({"datasets": {"a/b": {"source": "/x"}}}, file, 1, None, None)


# -- state folders from before the one ledger --------------------------------------------------
def test_state_folders_written_before_the_one_ledger_still_open(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data", n_small=4, big_sizes=(300_000,))
    st = HubState(data, tmp_path / "fold", "ds").open()
    first = st.scan().snapshot
    st.close()
    # The folder hub's tables as its own code made them: no objects, no digests tables.
    db = sqlite3.connect(tmp_path / "fold" / "state.sqlite", isolation_level=None)
    db.executescript("DROP TABLE objects; DROP TABLE digests;")
    db.close()
    st = HubState(data, tmp_path / "fold", "ds").open()
    again = st.scan()
    assert again.files_hashed == 0 and again.snapshot.id == first.id
    st.close()

    # A bucket hub's state as its code wrote it: objects, digests, snapshots, settings.
    sdir = tmp_path / "bucket"
    (sdir / "manifests").mkdir(parents=True)
    db = sqlite3.connect(sdir / "state.sqlite", isolation_level=None)
    db.executescript("""
        CREATE TABLE objects (version TEXT PRIMARY KEY, key TEXT, size INTEGER, etag TEXT,
            version_id TEXT, mtime_ns INTEGER);
        CREATE TABLE digests (version TEXT, idx INTEGER, digest BLOB,
            PRIMARY KEY (version, idx)) WITHOUT ROWID;
        CREATE TABLE snapshots (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE,
            created REAL, files INTEGER, bytes INTEGER);
        CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT);
        INSERT INTO settings VALUES ('block_size', '1048576'), ('source', 's3://bkt/p/');
        INSERT INTO objects VALUES ('ab', 'p/x', 5, '"e"', NULL, 0);
        INSERT INTO digests VALUES ('ab', 0, x'00112233445566778899aabbccddeeff');
        INSERT INTO snapshots (id, created, files, bytes) VALUES ('s1', 1.0, 1, 5);""")
    db.close()
    url = parse_store_url("s3://bkt/p")
    bst = BucketState(url, ObjectStoreOrigin(), sdir, "p", 4 << 20).open()
    assert bst.block_size == 1 << 20  # the state's own, not the one asked for
    assert [s.id for s in bst.snapshots()] == ["s1"]
    assert bst.stored("ab").key == "p/x" and bst.digests[("ab", 0)].hex().startswith("0011")
    bst.close()
    with pytest.raises(ConfigError, match="belongs to s3://bkt/p/"):
        BucketState(parse_store_url("s3://bkt/q"), ObjectStoreOrigin(), sdir, "q").open()
    with pytest.raises(ConfigError, match="belongs to a bucket dataset"):
        HubState(data, sdir, "ds").open()
    with pytest.raises(ConfigError, match="belongs to a folder dataset"):
        BucketState(url, ObjectStoreOrigin(), tmp_path / "fold", "p").open()


# -- many datasets -----------------------------------------------------------------------------
def test_two_hundred_datasets_load_and_list(tmp_path: Path) -> None:
    n = 200
    lines = []
    for i in range(n):
        small(tmp_path / "data" / f"d{i:03d}", f"dataset {i}\n")
        lines.append(f'[datasets.d{i:03d}]\nsource = "data/d{i:03d}"\n')
    config = tmp_path / "hub.toml"
    config.write_text("".join(lines))
    t0 = time.monotonic()
    with config_hub(config, tmp_path / "state") as h:
        listed = names(h.url)
        took = time.monotonic() - t0
        assert listed == [f"d{i:03d}" for i in range(n)]
        r = http.request("GET", f"{h.url}/d123/f.txt")
        assert r.status == 200 and r.data == b"dataset 123\n"
    print(f"{n} datasets: started, scanned and listed in {took:.2f} s")


# -- reload ------------------------------------------------------------------------------------
def test_datasets_added_and_removed_while_another_is_read(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", n_small=8, big_sizes=(2_000_000,))
    small(tmp_path / "b", "bee\n")
    config = tmp_path / "hub.toml"
    only_a = f'[datasets.a]\nsource = "{a}"\n'
    with_b = only_a + '[datasets.b]\nsource = "b"\nblock_size = "1MiB"\n'
    config.write_text(only_a)
    want = (a / "shards/shard-000.tar").read_bytes()
    with config_hub(config, tmp_path / "state") as h:
        assert names(h.url) == ["a"]
        failures: list[object] = []
        reads = [0]
        stop = threading.Event()

        def reader() -> None:
            pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(30))
            while not stop.is_set():
                try:
                    r = pool.request("GET", f"{h.url}/a/shards/shard-000.tar")
                    if r.status != 200 or r.data != want:
                        failures.append(r.status)
                except Exception as exc:  # a refused or cut connection is a failure too
                    failures.append(exc)
                reads[0] += 1

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            until(lambda: reads[0] > 0)
            config.write_text(with_b)  # an edit: seen by the file watcher
            until(lambda: names(h.url) == ["a", "b"])
            r = http.request("GET", f"{h.url}/b/f.txt")
            assert r.status == 200 and r.data == b"bee\n"
            doc = json.loads(http.request("GET", f"{h.url}/v1/datasets/b").data)
            assert doc["block_size"] == 1 << 20

            config.write_text("[datasets.a\nsource =")  # a bad edit: nothing changes
            out = output_with(h, "keeping the 2 datasets in force")
            assert "not valid TOML" in out
            assert names(h.url) == ["a", "b"]

            config.write_text(only_a)  # removed: its readers get a clear 404
            until(lambda: names(h.url) == ["a"])
            r = http.request("GET", f"{h.url}/b/f.txt")
            assert r.status == 404 and "was removed from this hub" in json.loads(r.data)[
                "error"]["message"]

            # SIGHUP alone: an edit the watcher cannot see (same inode, size and mtime).
            config.write_text(with_b)
            until(lambda: names(h.url) == ["a", "b"])
            st = config.stat()
            with config.open("r+") as f:
                f.write(with_b.replace("[datasets.b]", "[datasets.c]"))
            os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
            time.sleep(3)  # past a look of the watcher (2 s), which must see nothing
            assert names(h.url) == ["a", "b"]
            os.kill(h.pid, signal.SIGHUP)
            until(lambda: names(h.url) == ["a", "c"])
            assert http.request("GET", f"{h.url}/c/f.txt").data == b"bee\n"
            until(lambda: reads[0] > 20)
        finally:
            stop.set()
            t.join(30)
        assert failures == [] and reads[0] > 20


def kubelet_write(folder: Path, files: dict[str, str]) -> None:
    """What the kubelet does to a ConfigMap volume (its AtomicWriter): the files in a new
    timestamped folder, ``..data`` switched to it by a rename, each name a link through
    ``..data``. The Helm chart's hub reads its dataset list from such a volume."""
    folder.mkdir(exist_ok=True)
    stamp = folder / f"..{time.monotonic_ns()}"
    stamp.mkdir()
    for name, text in files.items():
        (stamp / name).write_text(text)
    tmp = folder / "..data_tmp"
    tmp.symlink_to(stamp.name)
    old = (folder / "..data").resolve() if (folder / "..data").is_symlink() else None
    os.rename(tmp, folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    if old is not None:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def test_a_config_map_update_adds_a_dataset_without_pausing_readers(tmp_path: Path) -> None:
    """The chart's hub.datasets: a ConfigMap volume the kubelet updates by switching a link.
    The hub sees the switch, scans the new dataset off its event loop, and a reader of
    another dataset sees no error meanwhile (the longest read it saw is printed)."""
    a = make_dataset(tmp_path / "a", n_small=8, big_sizes=())
    big = tmp_path / "data" / "big"
    for i in range(3000):  # a scan that takes a while, to be done beside the reader
        d = big / f"c{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(os.urandom(2048))
    conf = tmp_path / "conf"
    only_a = f'[datasets."a"]\nsource = "{a}"\n'
    kubelet_write(conf, {"hub.toml": only_a})
    want = (a / "class0/img0000.jpg").read_bytes()
    with config_hub(conf / "hub.toml", tmp_path / "state") as h:
        assert names(h.url) == ["a"]
        failures: list[object] = []
        slowest = [0.0]
        stop = threading.Event()

        def reader() -> None:
            pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(30))
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    r = pool.request("GET", f"{h.url}/a/class0/img0000.jpg")
                    if r.status != 200 or r.data != want:
                        failures.append(r.status)
                except Exception as exc:
                    failures.append(exc)
                slowest[0] = max(slowest[0], time.monotonic() - t0)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            kubelet_write(conf, {"hub.toml": only_a + f'[datasets."big"]\nsource = "{big}"\n'})
            until(lambda: names(h.url) == ["a", "big"], timeout=120)
            r = http.request("GET", f"{h.url}/big/c7/f7")
            assert r.status == 200 and r.data == (big / "c7/f7").read_bytes()
        finally:
            stop.set()
            t.join(30)
        assert failures == []
    print(f"reload of a 3000-file dataset: the slowest read of another took "
          f"{slowest[0] * 1000:.1f} ms")


# -- folders and buckets in one hub, behind one spoke ------------------------------------------
def test_a_spoke_reads_a_folder_and_a_bucket_of_one_hub(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    from spokefs_bench.s3server import TEST_ENV, S3Server

    folder = make_dataset(tmp_path / "imgs", n_small=4, big_sizes=(3_000_000,))
    body = os.urandom(2_500_000)
    with S3Server() as s3:
        c = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1",
                         aws_access_key_id="testing", aws_secret_access_key="testing")
        c.create_bucket(Bucket="bkt")
        c.put_object(Bucket="bkt", Key="texts/a/one.bin", Body=body)
        env = {**TEST_ENV, "AWS_ENDPOINT_URL": s3.url}
        with ServerProcess("hub", "serve", str(folder), "--port", "0", "--state-dir",
                           str(tmp_path / "st"), "--dataset", "texts=s3://bkt/texts",
                           "--block-size", "1MiB", env=env) as h, \
                spoke(h.url, tmp_path / "cache", "256MiB", "--deadline", "10s") as sp:
            assert names(h.url) == ["imgs", "texts"]
            assert names(sp.url) == ["imgs", "texts"]
            big = (folder / "shards/shard-000.tar").read_bytes()
            for _ in range(2):  # cold through the hub, then from the spoke's cache
                assert http.request("GET", f"{sp.url}/imgs/shards/shard-000.tar").data == big
                assert http.request("GET", f"{sp.url}/texts/a/one.bin").data == body
            status = json.loads(http.request("GET", f"{h.url}/v1/status").data)
            kinds = {d["name"]: d.get("digests") for d in status["datasets"]}
            assert kinds["imgs"] is None and kinds["texts"]["blocks"] == 3
