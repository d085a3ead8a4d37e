"""Operator and client control of a spoke: warm-up, residency, orders, purge, status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import urllib3

from spokefs.client.control import SpokeControl
from spokefs.errors import BadRequest
from test_spoke import metric, read_all

http = urllib3.PoolManager(retries=False)


def test_warm_then_reads_cross_nothing(spoke_server, dataset: Path) -> None:
    ctl = SpokeControl(f"{spoke_server.url}/ds")
    before = ctl.residency(prefix="")
    assert before["fraction"] == 0 and before["files"] == 23
    done = ctl.warm(prefix="", wait=True, progress=False, timeout=30)
    assert done["fraction"] == 1.0 and done["resident_files"] == 23
    fetched = metric(spoke_server.url, "spokefs_upstream_bytes_total")
    read_all(spoke_server.url, dataset)
    assert metric(spoke_server.url, "spokefs_upstream_bytes_total") == fetched


def test_warm_cli_with_progress(spoke_server, dataset: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "warm",
                        f"{spoke_server.url}/ds/class1",
                        "--wait", "--timeout", "30s"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "resident: 5/5 files" in r.stdout
    ctl = SpokeControl(f"{spoke_server.url}/ds")
    assert ctl.residency(prefix="class1")["fraction"] == 1.0
    assert ctl.residency(prefix="class2")["fraction"] == 0.0


def test_order_announcement(spoke_server, dataset: Path) -> None:
    ctl = SpokeControl(f"{spoke_server.url}/ds", job="j1")
    paths = sorted(str(p.relative_to(dataset)) for p in dataset.rglob("*.jpg"))
    r = ctl.announce(0, paths=paths[::-1])
    assert r["files"] == len(paths)
    with pytest.raises(BadRequest, match="not in"):
        ctl.announce(1, paths=["no/such.jpg"])
    ctl.epoch(1)
    ctl.end()


def test_purge_and_status(spoke_server, dataset: Path) -> None:
    read_all(spoke_server.url, dataset)
    assert metric(spoke_server.url, "spokefs_cache_bytes") > 0
    out = subprocess.run([sys.executable, "-m", "spokefs.cli", "status", spoke_server.url],
                         capture_output=True, text=True, timeout=30).stdout
    assert "hit ratio" in out and "upstream" in out
    r = http.request("POST", f"{spoke_server.url}/v1/purge", body=json.dumps({"dataset": "ds"}))
    assert r.status == 200 and json.loads(r.data)["freed_bytes"] > 0
    assert metric(spoke_server.url, "spokefs_cache_bytes") == 0
    read_all(spoke_server.url, dataset)  # and it refills


def test_bad_control_requests(spoke_server) -> None:
    base = spoke_server.url
    r = http.request("POST", f"{base}/v1/datasets/ds/warm", body=b"{not json")
    assert r.status == 400
    r = http.request("POST", f"{base}/v1/datasets/ds/residency",
                     body=json.dumps({"prefix": "nope"}))
    assert r.status == 400 and "nope" in json.loads(r.data)["error"]["message"]
    r = http.request("POST", f"{base}/v1/datasets/ds/jobs/j/order",
                     body=json.dumps({"indexes": [10**9]}))
    assert r.status == 400
