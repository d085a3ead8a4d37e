"""A hub over a bucket (``spokefs hub serve s3://...``), through a real S3 protocol server
(moto in server mode, a child process on 127.0.0.1) and real hub and spoke processes."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import random
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("obstore")
pytest.importorskip("moto")

import xxhash  # noqa: E402

import spokefs  # noqa: E402
from servers import ServerProcess, spoke  # noqa: E402
from spokefs.hub.bucket import key_paths  # noqa: E402
from spokefs.origin.s3 import ObjectInfo, parse_bucket_url  # noqa: E402
from spokefs.procs import StartError, cli  # noqa: E402
from spokefs_bench.s3server import TEST_ENV, S3Server  # noqa: E402

MiB = 1 << 20
BS = MiB  # the tests' block size: small objects still span several blocks


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


def client(s3: S3Server) -> Any:
    return boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def make_bucket(s3: S3Server, name: str, objects: dict[str, bytes],
                versioned: bool = False) -> Any:
    c = client(s3)
    c.create_bucket(Bucket=name)
    if versioned:
        c.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    for key, body in objects.items():
        c.put_object(Bucket=name, Key=key, Body=body)
    return c


def hub_env(s3: S3Server) -> dict[str, str]:
    return {**TEST_ENV, "AWS_ENDPOINT_URL": s3.url}


def bucket_hub(s3: S3Server, source: str, state: Path, *extra: str,
               env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess("hub", "serve", source, "--port", "0", "--state-dir", str(state),
                         "--block-size", str(BS), *extra, env=env or hub_env(s3))


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 30
        ) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def manifest(url: str, ds: str, snap: str = "latest") -> dict[str, Any]:
    status, body, _ = get(f"{url}/v1/datasets/{ds}/snapshots/{snap}/manifest")
    assert status == 200
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def snapshot(url: str, ds: str) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/datasets/{ds}/snapshots", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def rnd(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_key_rules() -> None:
    def obj(key: str, size: int = 1) -> ObjectInfo:
        return ObjectInfo(key, size, '"e"', None, 0)

    files, dirs, skipped = key_paths(
        [obj("p/"), obj("p/a/b"), obj("p/a/b/c"), obj("p/empty/", 0), obj("p/full/", 3),
         obj("p/x//y"), obj("p/./z"), obj("p/../up"), obj("p/ok file"), obj("p/ü/é")], "p/")
    assert sorted(files) == ["a/b/c", "ok file", "ü/é"]
    assert dirs == ["", "a", "a/b", "empty", "ü"]  # a folder marker is an (empty) folder
    left = dict(skipped)
    assert set(left) == {"p/a/b", "p/full/", "p/x//y", "p/./z", "p/../up"}
    assert "folder" in left["p/a/b"]
    assert parse_bucket_url("s3://bkt/a/b/").prefix == "a/b/"
    assert parse_bucket_url("s3://bkt").prefix == ""
    assert parse_bucket_url("s3://bkt/train").default_name == "train"
    assert parse_bucket_url("s3://bkt/").default_name == "bkt"


def test_listing_to_manifest_awkward_keys(s3: S3Server, tmp_path: Path) -> None:
    objects = {
        "sets/imgs/with space.bin": rnd(1000, 1),
        "sets/imgs/ünïcødé/日本.bin": rnd(2000, 2),
        "sets/imgs/a/b": b"file a/b",        # also a folder: left out
        "sets/imgs/a/b/c": b"file a/b/c",
        "sets/imgs/marker/": b"",            # a folder marker: an empty folder
        "sets/imgs/odd%20name+?#": b"odd",
        "sets/imgs/empty": b"",
        "sets/imgs/big": rnd(3 * BS + 5, 3),
        "sets/imgsX/not-under-prefix": b"no",
    }
    make_bucket(s3, "awkward", objects)
    with bucket_hub(s3, "s3://awkward/sets/imgs", tmp_path / "st") as hub:
        m = manifest(hub.url, "imgs")  # the name: the prefix's last part
        assert m["paths"] == sorted(["with space.bin", "ünïcødé/日本.bin", "a/b/c",
                                     "odd%20name+?#", "empty", "big"])
        assert m["dirs"] == ["", "a", "a/b", "marker", "ünïcødé"]
        assert m["block_size"] == BS
        assert set(m["modes"]) == {0o444}
        assert all(re.fullmatch(r"[0-9a-f]{32}", v) for v in m["versions"])
        assert len(set(m["versions"])) == len(m["versions"])
        for path, size in zip(m["paths"], m["sizes"], strict=True):
            want = objects[f"sets/imgs/{path}"]
            assert size == len(want)
            status, body, _ = get(f"{hub.url}/imgs/{quote(path)}")
            assert (status, body) == (200, want), path
        assert "left out key 'sets/imgs/a/b'" in "".join(hub.lines)
        again = snapshot(hub.url, "imgs")  # nothing changed: the same snapshot
        assert again["new"] is False and again["id"] == m["snapshot"]
    with bucket_hub(s3, "s3://awkward/sets/imgs", tmp_path / "st2", "--name", "pics") as hub:
        assert manifest(hub.url, "pics")["paths"] == m["paths"]
    with pytest.raises(StartError, match="belongs to s3://awkward/sets/imgs/"):
        bucket_hub(s3, "s3://awkward/sets", tmp_path / "st").start()


@pytest.mark.slow
def test_listing_costs_list_requests_only(s3: S3Server, tmp_path: Path) -> None:
    c = make_bucket(s3, "many", {})
    n = 1500  # two pages
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: c.put_object(Bucket="many", Key=f"k/{i:05d}", Body=b"x"),
                      range(n)))
    mark = len(s3.lines)
    with bucket_hub(s3, "s3://many/k", tmp_path / "st") as hub:
        assert len(manifest(hub.url, "k")["paths"]) == n
    requests = [line for line in s3.lines[mark:] if '"' in line]
    lists = [r for r in requests if "list-type=2" in r or "versions" in r]
    # (werkzeug colours some request lines: match the method and path, not the quote)
    per_object = [r for r in requests if re.search(r'(GET|HEAD) /many/k/', r)]
    assert len([r for r in lists if "list-type=2" in r]) == (n + 999) // 1000
    assert per_object == []


def test_ranged_reads_across_block_edges_through_spoke(s3: S3Server, tmp_path: Path
                                                       ) -> None:
    data = rnd(3 * BS + 12345, 7)
    make_bucket(s3, "edges", {"ds/shard.tar": data, "ds/small": b"tiny"})
    with bucket_hub(s3, "s3://edges/ds", tmp_path / "st") as hub, \
            spoke(hub.url, tmp_path / "cache", "1GiB", "--deadline", "5s") as sp:
        for a, b in [(BS - 10, BS + 10), (0, 1), (2 * BS - 1, 2 * BS + 1),
                     (3 * BS - 3, len(data)), (5, 3 * BS + 2), (0, len(data))]:
            status, body, headers = get(f"{sp.url}/ds/shard.tar",
                                        {"Range": f"bytes={a}-{b - 1}"})
            assert status in (200, 206) and body == data[a:b], (a, b)
        assert get(f"{sp.url}/ds/small")[1] == b"tiny"
        with spokefs.open(f"{sp.url}/ds/shard.tar") as f:  # the client library, unchanged
            f.seek(2 * BS - 7)
            assert f.read(14) == data[2 * BS - 7:2 * BS + 7]
        # A whole block from the hub carries the digest it made while reading it.
        status, body, headers = get(f"{hub.url}/ds/shard.tar",
                                    {"Range": f"bytes={BS}-{2 * BS - 1}"})
        assert status == 206 and body == data[BS:2 * BS]
        assert headers["X-Spokefs-Block-Digest"] == xxhash.xxh3_128_hexdigest(body)
        metrics = get(f"{sp.url}/metrics")[1].decode()
        assert not re.search(r'^spokefs_integrity_failures_total\{[^}]*\} [1-9]', metrics,
                             re.M)
    # The digests were remembered: a new hub on the same state checks against them.
    with bucket_hub(s3, "s3://edges/ds", tmp_path / "st") as hub:
        assert get(f"{hub.url}/ds/shard.tar")[1] == data


def test_snapshot_hash_ahead(s3: S3Server, tmp_path: Path) -> None:
    make_bucket(s3, "hashing", {"h/a": rnd(2 * BS + 1, 41), "h/b": b"b", "h/empty": b""})
    args = ["hub", "snapshot", "s3://hashing/h", "--state-dir", str(tmp_path / "st"),
            "--block-size", str(BS), "--hash"]
    env = {**os.environ, **hub_env(s3)}
    first = json.loads(subprocess.run(cli(*args), env=env, capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
    assert first["new"] is True and first["files"] == 3
    assert (first["blocks_hashed"], first["bytes_hashed"]) == (4, 2 * BS + 2)
    again = json.loads(subprocess.run(cli(*args), env=env, capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
    assert again["new"] is False and again["blocks_hashed"] == 0  # remembered

    def digests(hub: ServerProcess) -> dict[str, object]:
        (ds,) = json.loads(get(f"{hub.url}/v1/status")[1])["datasets"]
        return ds["digests"]

    # Status says which snapshot is bound to its digests and which trusts first reads.
    with bucket_hub(s3, "s3://hashing/h", tmp_path / "st") as hub:
        assert digests(hub) == {"bound": True, "blocks": 4, "first_read_blocks": 0}
    with bucket_hub(s3, "s3://hashing/h", tmp_path / "unhashed") as hub:
        assert digests(hub) == {"bound": False, "blocks": 4, "first_read_blocks": 4}
        assert get(f"{hub.url}/h/a")[1] == rnd(2 * BS + 1, 41)  # reading records them
        assert digests(hub) == {"bound": False, "blocks": 4, "first_read_blocks": 1}


def test_overwrite_under_pinned_snapshot_is_410(s3: S3Server, tmp_path: Path) -> None:
    old, new = rnd(3 * BS, 11), rnd(3 * BS, 12)
    c = make_bucket(s3, "overwrite", {"d/f.bin": old, "d/other": b"stays"})
    with bucket_hub(s3, "s3://overwrite/d", tmp_path / "st") as hub, \
            spoke(hub.url, tmp_path / "cache", "1GiB", "--deadline", "5s") as sp:
        snap = manifest(hub.url, "d")["snapshot"]
        first = get(f"{sp.url}/d@{snap}/f.bin", {"Range": f"bytes=0-{BS - 1}"})
        assert first[1] == old[:BS]  # block 0 now cached by the spoke
        c.put_object(Bucket="overwrite", Key="d/f.bin", Body=new)
        # Block 1 was never read: the pinned version is gone, never the new bytes.
        status, body, _ = get(f"{sp.url}/d@{snap}/f.bin", {"Range": f"bytes={BS}-{BS + 99}"})
        assert status == 410 and b"version_gone" in body
        status, body, _ = get(f"{hub.url}/d@{snap}/f.bin")
        assert status == 410
        try:
            status, body, _ = get(f"{sp.url}/d@{snap}/f.bin")
        except (http.client.HTTPException, OSError):
            status, body = -1, b""  # a response cut after block 0: also no mixed bytes
        assert body != new and (status == 410 or new[BS:2 * BS] not in body)
        assert get(f"{sp.url}/d@{snap}/other")[1] == b"stays"
        fresh = snapshot(hub.url, "d")
        assert fresh["new"] is True
        assert get(f"{sp.url}/d@{fresh['id']}/f.bin")[1] == new


def test_versioned_bucket_keeps_a_snapshot_readable(s3: S3Server, tmp_path: Path) -> None:
    old, new = rnd(2 * BS + 1, 21), rnd(2 * BS + 1, 22)
    c = make_bucket(s3, "versioned", {"v/f": old}, versioned=True)
    with bucket_hub(s3, "s3://versioned/v", tmp_path / "st") as hub:
        snap = manifest(hub.url, "v")["snapshot"]
        c.put_object(Bucket="versioned", Key="v/f", Body=new)
        # The snapshot pinned the VersionId: the old bytes are still there to read.
        assert get(f"{hub.url}/v@{snap}/f")[1] == old
        assert get(f"{hub.url}/v@{snapshot(hub.url, 'v')['id']}/f")[1] == new
        c.delete_object(Bucket="versioned", Key="v/f")  # a delete marker
        assert get(f"{hub.url}/v@{snap}/f")[1] == old
        assert manifest(hub.url, "v", snapshot(hub.url, "v")["id"])["paths"] == []


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYSECRETKEYx9"


def test_credentials_refused_clear_error(tmp_path: Path) -> None:
    with S3Server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as strict:
        env = {**hub_env(strict), "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0001",
               "AWS_SECRET_ACCESS_KEY": SECRET}
        h = bucket_hub(strict, "s3://locked/x", tmp_path / "st", env=env)
        with pytest.raises(StartError) as info:
            h.start(timeout=60)
        text = str(info.value)
        assert "refused the credentials" in text and "bucket 'locked'" in text
        assert SECRET not in text
    # No credentials anywhere (no variables, no profile, no instance role to ask).
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "",
           "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    h = ServerProcess("hub", "serve", "s3://anything/x", "--port", "0", "--state-dir",
                      str(tmp_path / "st2"), env=env)
    with pytest.raises(StartError) as info:
        h.start(timeout=60)
    assert "no AWS credentials found" in str(info.value)
    env["AWS_PROFILE"] = "nowhere"
    h = ServerProcess("hub", "serve", "s3://anything/x", "--port", "0", "--state-dir",
                      str(tmp_path / "st3"), env=env)
    with pytest.raises(StartError) as info:
        h.start(timeout=60)
    assert "AWS profile 'nowhere'" in str(info.value) and "Traceback" not in str(info.value)


def test_shared_profile_credentials(s3: S3Server, tmp_path: Path) -> None:
    make_bucket(s3, "profiled", {"p/f": b"from a profile"})
    creds = tmp_path / "credentials"
    creds.write_text("[spokefs-test]\naws_access_key_id = testing\n"
                     "aws_secret_access_key = testing\n")
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "spokefs-test",
           "AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": str(tmp_path / "cfg"),
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1"}
    with bucket_hub(s3, "s3://profiled/p", tmp_path / "st", "--endpoint-url", s3.url,
                    env=env) as hub:
        assert get(f"{hub.url}/p/f")[1] == b"from a profile"
        assert "testing" not in "".join(hub.lines).replace("spokefs-test", "")


@pytest.mark.slow
def test_s3_down_cached_reads_go_on(tmp_path: Path) -> None:
    cached, uncached = rnd(2 * BS + 7, 31), rnd(BS + 3, 32)
    deadline = 3.0
    with S3Server() as down:
        make_bucket(down, "downtime", {"d/cached": cached, "d/uncached": uncached})
        with bucket_hub(down, "s3://downtime/d", tmp_path / "st") as hub, \
                spoke(hub.url, tmp_path / "cache", "1GiB", "--deadline", f"{deadline}s") as sp:
            assert get(f"{sp.url}/d/cached")[1] == cached
            down.kill()
            assert get(f"{sp.url}/d/cached")[1] == cached
            assert get(f"{sp.url}/d/cached", {"Range": "bytes=5-1048580"})[1] == cached[5:1048581]
            t0 = time.monotonic()
            status, body, _ = get(f"{sp.url}/d/uncached", timeout=60)
            took = time.monotonic() - t0
            assert status == 503 and b"upstream_unavailable" in body
            assert took < deadline + 10, took  # the deadline, plus a loaded machine's slack
            assert down.url.split("//")[1] not in body.decode()  # no address to clients
            assert os.environ.get("AWS_SECRET_ACCESS_KEY", "testing") not in body.decode()


@pytest.mark.slow
def test_bench_s3client_runs(tmp_path: Path) -> None:
    """The client comparison (docs/architecture.md) still runs; its figures are not checked."""
    out = subprocess.run(cli("bench", "s3client", "--out", str(tmp_path), "--clients",
                             "obstore,boto3", "--ranges", "1MiB", "--objects", "1",
                             "--object-size", "2MiB", "--bytes", "4MiB", "--inflight", "4"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["client"] for r in rows] == ["obstore", "boto3"]
    assert all(r["bytes"] == 4 * MiB and r["cpu_s_per_gib"] > 0 for r in rows)
