"""Working-set learning without hints, persisted across spoke restarts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import urllib3

from servers import spoke
from spokefs.client.control import SpokeControl
from test_spoke import metric, read_all

http = urllib3.PoolManager(retries=False)


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_epoch_scan_is_learned_and_refilled_after_restart(hub_server, dataset: Path,
                                                          tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with spoke(hub_server.url, cache) as s:
        read_all(s.url, dataset)  # epoch 1: the planner sees a scan
        read_all(s.url, dataset)  # epoch 2: files come back, the set is learned
        status = json.loads(http.request("GET", f"{s.url}/v1/status").data)
        assert status["prefetch"]["scans_detected"] >= 1
        # Drop every cached byte: only the learned set is left.
        http.request("POST", f"{s.url}/v1/purge", body=b"{}")
        assert metric(s.url, "spokefs_cache_bytes") == 0
    with spoke(hub_server.url, cache) as s2:
        ctl = SpokeControl(f"{s2.url}/ds")
        # No reader has asked for anything, yet the job's working set fills.
        assert wait_for(lambda: ctl.residency(prefix="")["fraction"] > 0.9)
        assert metric(s2.url, "spokefs_cache_misses_total") == 0
