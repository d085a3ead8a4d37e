"""Per-dataset residency and retention on a spoke (--dataset-config): deny, TTL, shares."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import urllib3

from servers import hub, make_dataset, metric, spoke
from spokefs.cache.inspect import blocks_on_disk
from spokefs.cache.store import BlockStore
from spokefs.errors import ConfigError
from spokefs.policy import CopiesFirst, Shares, make_policy
from spokefs.spoke.datasets import DatasetConfig, parse_rules
from spokefs.spoke.fairshare import FairShares
from spokefs.wire.auth import Token
from spokefs.wire.authz import visible_metrics, visible_status

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


def test_reserved_shares_are_checked(tmp_path: Path) -> None:
    default, rules = parse_rules('[default]\nidle_after = "1h"\nmax_share = 0.8\n'
                                 '[datasets.a]\nmin_share = 0.3\nmax_share = 0.5\n'
                                 '[datasets.b]\nmin_share = 0.7\nidle_after = "30s"\n')
    assert rules["a"].min_share == 0.3 and rules["a"].idle_after == 600  # the default window
    assert rules["b"].idle_after == 30 and default.idle_after == 3600
    for bad, why in (("[datasets.a]\nmin_share = 0.6\n[datasets.b]\nmin_share = 0.5\n",
                      r"min_share adds up to 1\.1 \(\[datasets\.a\] 0\.6, \[datasets\.b\] 0\.5\)"),
                     ("[datasets.a]\nmin_share = 0.6\nmax_share = 0.5\n",
                      r"\[datasets\.a\]: min_share 0\.6 is above max_share 0\.5"),
                     ("[datasets.a]\nmin_share = 0\n", r"\[datasets\.a\]: min_share must be"),
                     ("[default]\nmin_share = 0.1\n", r"\[default\]: min_share is reserved per"),
                     ('[datasets.a]\nmin_share = 0.1\ncache = "deny"\n', "nothing is kept"),
                     ('[datasets.a]\nidle_after = "soon"\n', "soon")):
        with pytest.raises(ConfigError, match=why):
            parse_rules(bad, "rules.toml")
    f = tmp_path / "rules.toml"
    f.write_text("[datasets.a]\nmin_share = 0.6\nmax_share = 0.5\n")
    with pytest.raises(ConfigError, match=rf"{f} \[datasets\.a\]: min_share"):
        DatasetConfig(f)  # the file, the table and the key


def test_a_token_sees_the_shares_of_its_datasets_only() -> None:
    rows = [{"dataset": "a", "resident_bytes": 1, "min_bytes": 2},
            {"dataset": "b", "resident_bytes": 3, "min_bytes": 0}]
    doc = {"role": "spoke", "datasets": {"shares": rows, "resident_bytes": {"a": 1, "b": 3}}}
    reader = Token("reader", admin=False, datasets=frozenset({"a"}))
    seen = visible_status(doc, reader)["datasets"]
    assert seen["shares"] == rows[:1] and seen["resident_bytes"] == {"a": 1}
    text = (b'spokefs_dataset_reserved_bytes{dataset="a"} 2.0\n'
            b'spokefs_dataset_reserved_bytes{dataset="b"} 5.0\n')
    assert visible_metrics(text, reader) == text.split(b"\n", 1)[0] + b"\n"
    assert visible_status(doc, Token("ops", admin=True, datasets=None)) == doc


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


def read_dataset(base: str, name: str, root: Path, under: Path | None = None) -> None:
    for p in sorted((under or root).rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            assert http.request("GET", f"{base}/{name}/{rel}").data == p.read_bytes(), rel


def misses(base: str, dataset: str) -> int:
    return status(base)["datasets"]["hits_misses"].get(dataset, [0, 0])[1]


def contend(base: str, a: Path, b: Path) -> int:
    """Job A reads its dataset again and again while job B scans a larger one than the
    cache (in parts each larger than the cache too); A's misses (blocks fetched from the hub
    again) once A was read in full."""
    read_dataset(base, "a", a)
    before = misses(base, "a")
    for part in sorted(b.iterdir()):  # B's scan, a folder at a time, A read between
        read_dataset(base, "b", b, part)
        read_dataset(base, "a", a)
    return misses(base, "a") - before


# One process (no replica workers: their hits reach the spoke's eviction order a moment later,
# so which of A and B is least recently used would depend on timing), no prefetch.
ONE = ("--workers", "1", "--no-prefetch")


def test_a_reserved_share_keeps_a_jobs_blocks_beside_a_scan(tmp_path: Path) -> None:
    """Two datasets through one small spoke: A (about 2 MB) reads in a loop, B (2 x 18 MiB,
    the cache is 16 MiB) scans. With A's min_share its blocks stay resident (no refetch); without
    it, B's scan evicts them; a reload that brings the share protects A from then on."""
    a = make_dataset(tmp_path / "a", n_small=20, big_sizes=(), seed=2)
    b = tmp_path / "b"
    for i in range(2):  # each part more than the cache
        make_dataset(b / f"part{i}", n_small=0, big_sizes=(4 << 20,) * 4 + (2 << 20,),
                     seed=10 + i)
    rules = tmp_path / "rules.toml"
    rules.write_text("[datasets.a]\nmin_share = 0.4\n")
    with hub(a, tmp_path / "hubstate", "--name", "a", "--dataset", f"b={b}") as h:
        with spoke(h.url, tmp_path / "c1", "16MiB", *ONE, "--dataset-config",
                   str(rules)) as s:
            assert contend(s.url, a, b) == 0
            doc = status(s.url)["datasets"]
            held = doc["resident_bytes"]
            assert held["a"] == sum(p.stat().st_size for p in a.rglob("*") if p.is_file())
            assert misses(s.url, "b") > 0 and held["b"] > 0
            row = {r["dataset"]: r for r in doc["shares"]}["a"]
            assert row["min_bytes"] == int(0.4 * (16 << 20)) and row["in_use"] is True
            assert row["share"] == "under" and row["resident_bytes"] == held["a"]
            assert metric(s.url, "spokefs_dataset_reserved_bytes", dataset="a") == \
                row["min_bytes"]
            assert metric(s.url, "spokefs_dataset_resident_bytes", dataset="a") == held["a"]
            assert metric(s.url, "spokefs_dataset_in_use", dataset="a") == 1

        rules.write_text('[datasets.b]\nttl = "1h"\n')  # no reservation
        with spoke(h.url, tmp_path / "c2", "16MiB", *ONE, "--dataset-config",
                   str(rules)) as s:
            assert contend(s.url, a, b) > 0  # B's scan evicted A's blocks: fetched again
            assert {r["dataset"]: r for r in status(s.url)["datasets"]["shares"]}["a"][
                "in_use"] is None
            rules.write_text("[datasets.a]\nmin_share = 0.4\n")
            end = time.monotonic() + 20  # read again when it changes
            while not any(r["min_bytes"] for r in status(s.url)["datasets"]["shares"]):
                assert time.monotonic() < end, "the changed rules were never read"
                time.sleep(0.2)
            assert contend(s.url, a, b) == 0


def test_the_plain_policy_stays_unless_a_share_is_reserved(tmp_path: Path) -> None:
    """No min_share: the store keeps its policy object itself (nothing added on a hit); the
    first reservation wraps it, the last one gone gives it back; a tier member's copies
    stay outside."""
    rules = tmp_path / "rules.toml"
    rules.write_text('[datasets.a]\nttl = "1h"\nmax_share = 0.5\n')
    for copies in (False, True):
        policy = make_policy("lru", copies=copies)
        store = BlockStore(tmp_path / "c", 64 << 20, policy)
        config = DatasetConfig(rules)
        shares = FairShares(store, config)
        owned = policy.owned if isinstance(policy, CopiesFirst) else policy
        assert store.policy is policy and owned.name == "lru" and shares.shares is None
        rules.write_text("[datasets.a]\nmin_share = 0.25\n")
        assert config.reload()
        inner = store.policy.owned if copies else store.policy  # type: ignore[attr-defined]
        assert isinstance(inner, Shares) and inner.shared is owned and store.policy.name == "lru"
        assert inner.shares["a"].min_bytes == 16 << 20
        rules.write_text('[datasets.a]\nttl = "1h"\n')
        assert config.reload()
        assert store.policy is policy and (not copies or policy.owned is owned)
        assert shares.shares is None
