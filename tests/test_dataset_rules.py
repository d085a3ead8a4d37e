"""Per-dataset residency and retention on a spoke (--dataset-config): deny, TTL, share."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import urllib3

from servers import metric, spoke
from spokefs.cache.inspect import blocks_on_disk
from spokefs.errors import ConfigError
from spokefs.spoke.datasets import parse_rules

http = urllib3.PoolManager(retries=False)


def status(base: str) -> dict:
    return json.loads(http.request("GET", f"{base}/v1/status").data)


def read_all(base: str, dataset: Path) -> None:
    for p in sorted(dataset.rglob("*")):
        if p.is_file():
            rel = p.relative_to(dataset).as_posix()
            assert http.request("GET", f"{base}/ds/{rel}").data == p.read_bytes(), rel


def test_rules_are_checked() -> None:
    default, rules = parse_rules('[default]\nttl = "30d"\n[datasets.a]\ncache = "deny"\n'
                                '[datasets.b]\nmax_share = 0.25\nttl = "2h"\n')
    assert default.ttl == 30 * 86400 and not rules["a"].cache
    assert rules["b"].max_share == 0.25 and rules["b"].ttl == 7200
    for bad, why in (('[datasets.a]\ncache = "maybe"\n', "allow"),
                     ("[datasets.a]\nmax_share = 2\n", "max_share"),
                     ("[datasets.a]\nttl = 5\nkeep = 1\n", "unknown key"),
                     ("[other]\n", "unknown table"), ("not toml [", "not TOML")):
        with pytest.raises(ConfigError, match=why):
            parse_rules(bad)


def test_deny_leaves_no_byte_in_the_cache(hub_server, dataset: Path, tmp_path: Path) -> None:
    (tmp_path / "rules.toml").write_text('[datasets.ds]\ncache = "deny"\n')
    cache = tmp_path / "cache"
    with spoke(hub_server.url, cache, "256MiB", "--dataset-config",
               str(tmp_path / "rules.toml")) as s:
        read_all(s.url, dataset)  # a whole epoch, served
        read_all(s.url, dataset)
        assert metric(s.url, "spokefs_passthrough_bytes_total") > 0
        assert status(s.url)["datasets"]["resident_bytes"] == {}
    assert blocks_on_disk(cache) == []
    held = sum(p.stat().st_blocks for p in (cache / "segments").glob("*"))
    assert held == 0, f"{held * 512} bytes of data on disk"


def test_ttl_makes_a_block_unreadable_from_the_cache_then_refetched(
        hub_server, dataset: Path, tmp_path: Path) -> None:
    (tmp_path / "rules.toml").write_text('[datasets.ds]\nttl = "1s"\n')
    name = "class0/img0000.jpg"
    with spoke(hub_server.url, tmp_path / "cache", "256MiB", "--no-prefetch",
               "--dataset-config", str(tmp_path / "rules.toml")) as s:
        assert http.request("GET", f"{s.url}/ds/{name}").data == (dataset / name).read_bytes()
        pulled = metric(s.url, "spokefs_upstream_bytes_total")
        assert pulled > 0
        end = time.monotonic() + 20  # past the TTL, the spoke drops it (within a pass)
        while status(s.url)["datasets"]["resident_bytes"] and time.monotonic() < end:
            time.sleep(0.2)
        assert status(s.url)["datasets"]["resident_bytes"] == {}
        assert http.request("GET", f"{s.url}/ds/{name}").data == (dataset / name).read_bytes()
        assert metric(s.url, "spokefs_upstream_bytes_total") > pulled  # fetched again


def test_max_share_bounds_a_dataset_and_rules_reload(hub_server, dataset: Path,
                                                      tmp_path: Path) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text("[datasets.ds]\nmax_share = 0.1\n")
    with spoke(hub_server.url, tmp_path / "cache", "64MiB", "--no-prefetch",
               "--dataset-config", str(rules)) as s:
        read_all(s.url, dataset)  # ~14 MB of files, 6.4 MiB allowed
        held = status(s.url)["datasets"]["resident_bytes"]["ds"]
        assert 0 < held <= 0.1 * (64 << 20)
        rules.write_text('[datasets.ds]\nmax_share = 0.5\nttl = "1h"\n')
        end = time.monotonic() + 20  # read again when it changes
        while status(s.url)["datasets"]["datasets"]["ds"]["ttl"] is None:
            assert time.monotonic() < end, "the changed rules were never read"
            time.sleep(0.2)
        read_all(s.url, dataset)
        assert status(s.url)["datasets"]["resident_bytes"]["ds"] > held


def test_a_bad_config_stops_the_spoke_with_a_message(hub_server, tmp_path: Path) -> None:
    (tmp_path / "rules.toml").write_text('[datasets.ds]\ncache = "maybe"\n')
    run = subprocess.run([sys.executable, "-m", "spokefs.cli", "spoke", "serve", "--upstream",
                          hub_server.url, "--cache-dir", str(tmp_path / "c"), "--cache-size",
                          "64MiB", "--port", "0", "--dataset-config",
                          str(tmp_path / "rules.toml")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "cache must be" in run.stderr
