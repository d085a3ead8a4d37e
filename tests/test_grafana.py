"""The Grafana dashboard shipped in deploy/grafana/ asks only for metrics a real hub and spoke
export, and those metrics follow Prometheus's naming conventions."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from servers import ServerProcess

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "spokefs.json"
METRIC = re.compile(r"\bspokefs_[a-zA-Z0-9_]+")
# The sample names each kind of family exposes (prometheus_client adds the suffixes).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created"), "info": ("_info",),
            "unknown": ("",)}


def panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc["panels"]:
        yield p
        yield from p.get("panels", ())  # a collapsed row holds its panels


def queries(doc: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in panels(doc) for t in p.get("targets", ())]
    for v in doc["templating"]["list"]:
        q = v.get("query")
        if v["type"] == "query":
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def scrape(url: str) -> list[Any]:
    text = urllib3.request("GET", f"{url}/metrics", timeout=10).data.decode()
    return [f for f in text_string_to_metric_families(text) if f.name.startswith("spokefs_")]


@pytest.fixture
def families(hub_server: ServerProcess, spoke_server: ServerProcess) -> dict[str, Any]:
    return {f.name: f for url in (hub_server.url, spoke_server.url) for f in scrape(url)}


def test_dashboard_is_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["title"] and p["targets"], p
        assert p["datasource"]["uid"] == "${datasource}"  # no data source id baked in
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_dashboard_covers_what_an_operator_asks() -> None:
    used = {m for q in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(q)}
    for name in ("spokefs_cache_hits_total", "spokefs_cache_misses_total",
                 "spokefs_upstream_bytes_total", "spokefs_served_bytes_total",
                 "spokefs_cache_bytes", "spokefs_cache_capacity_bytes",
                 "spokefs_prefetch_window_bytes", "spokefs_upstream_inflight",
                 "spokefs_fetch_seconds_bucket", "spokefs_cache_evictions_total",
                 "spokefs_integrity_failures_total", "spokefs_upstream_errors_total"):
        assert name in used, name


def test_every_metric_in_the_dashboard_exists(families: dict[str, Any]) -> None:
    exported = {f.name + suffix for f in families.values() for suffix in SUFFIXES[f.type]}
    used = {m for q in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(q)}
    assert used, "the dashboard queries no spokefs metric"
    missing = sorted(used - exported)
    assert not missing, f"the dashboard asks for metrics no hub or spoke exports: {missing}"


def test_metric_names_follow_the_conventions(families: dict[str, Any]) -> None:
    for name, f in families.items():
        if name.endswith("_created"):  # the text format's own gauge of a counter's start
            continue
        assert re.fullmatch(r"spokefs_[a-z0-9_]+", name), name
        # prometheus_client adds _total to a counter: a name ending in it would double it.
        assert not name.endswith("_total"), name
        # The unit is the name's last word (spokefs_upstream_bytes, not ..._bytes_count).
        for unit in ("bytes", "seconds"):
            if unit in name.split("_"):
                assert name.endswith(f"_{unit}"), name
        if f.type == "histogram":
            assert name.endswith(("_seconds", "_bytes")), name
