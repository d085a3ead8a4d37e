"""The Grafana dashboard shipped in deploy/grafana/ and the chart's alert rules (its
PrometheusRule) ask only for metrics a real hub and spoke export (a spoke in a tier, a hub
over a bucket), and those metrics follow Prometheus's naming conventions."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from servers import ServerProcess, free_port, spoke

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "spokefs.json"
CHART = ROOT / "deploy" / "helm" / "spokefs"
RULES = CHART / "templates" / "prometheusrule.yaml"
CAPABILITY = '(.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")'
METRIC = re.compile(r"\bspokefs_[a-zA-Z0-9_]+")
SELECTOR = re.compile(r"\b(spokefs_[a-zA-Z0-9_]+)(\{[^}]*\})?")
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
def families(hub_server: ServerProcess, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Every family a hub on a folder, a spoke in a tier and (where the s3 extra and moto
    are installed) a hub over a bucket export: real processes, scraped."""
    port = free_port()
    # a tier of this spoke and a member that never answers: the tier's metrics are there
    members = f"http://127.0.0.1:{port},http://127.0.0.1:{free_port()}"
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--port", str(port), "--workers",
               "1", "--tier", members, "--tier-timeout", "1s") as s:
        out = {f.name: f for url in (hub_server.url, s.url) for f in scrape(url)}
        out.update(bucket_hub_families(tmp_path))
        yield out


def bucket_hub_families(tmp_path: Path) -> dict[str, Any]:
    try:
        import boto3

        from spokefs_bench.s3server import TEST_ENV, S3Server
    except ImportError:  # the s3 extra or moto missing: the test of their metrics skips
        return {}
    with S3Server() as s3:
        boto3.client("s3", endpoint_url=s3.url, region_name=TEST_ENV["AWS_REGION"],
                     aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"]
                     ).create_bucket(Bucket="metrics")
        with ServerProcess("hub", "serve", "s3://metrics/ds", "--port", "0", "--state-dir",
                           str(tmp_path / "bucket-state"),
                           env={**TEST_ENV, "AWS_ENDPOINT_URL": s3.url}) as h:
            return {f.name: f for f in scrape(h.url)}


def exported_names(families: dict[str, Any]) -> set[str]:
    return {f.name + suffix for f in families.values() for suffix in SUFFIXES[f.type]}


def render_rules(values: dict[str, Any], tmp_path: Path, capability: bool
                 ) -> list[dict[str, Any]]:
    """The chart's PrometheusRule documents rendered by Helm's own engine, on a copy of the
    chart. Helm's offline render offers no cluster API versions: ``capability`` stands the
    check for monitoring.coreos.com/v1 in with true (else it stays, and is false). The copy
    drops values.schema.json (tests/test_helm_chart.py checks the schema), so the rules are
    tested whether or not the schema lists prometheusRule yet."""
    helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
    yaml = pytest.importorskip("yaml")
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink(missing_ok=True)
    template = chart / "templates" / RULES.name
    text = template.read_text()
    assert CAPABILITY in text, "the rules must be rendered only where the operator's API is"
    if capability:
        template.write_text(text.replace(CAPABILITY, "true"))
    with helm_python.Chart.load(chart) as c:
        out = c.render(values, name="train", namespace="ml")
    return [d for d in yaml.safe_load_all(out.get(f"spokefs/templates/{RULES.name}", ""))
            if d]


def rule_queries(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {r["alert"]: r["expr"] for d in docs for g in d["spec"]["groups"]
            for r in g["rules"]}


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
                 "spokefs_integrity_failures_total", "spokefs_upstream_errors_total",
                 # a namespace's shares (--dataset-config min_share, max_share)
                 "spokefs_dataset_resident_bytes", "spokefs_dataset_reserved_bytes",
                 "spokefs_dataset_ceiling_bytes", "spokefs_dataset_in_use"):
        assert name in used, name


def test_dashboard_has_tier_panels_and_cluster_namespace_variables() -> None:
    doc = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names[:3] == ["datasource", "cluster", "namespace"], names
    used = {m for q in queries(doc) for m in METRIC.findall(q)}
    for name in ("spokefs_tier_members", "spokefs_tier_peer_bytes_total",
                 "spokefs_tier_served_bytes_total", "spokefs_tier_peer_requests_total",
                 "spokefs_tier_rerouted_blocks_total", "spokefs_tier_handoff_blocks_total",
                 "spokefs_tier_peer_blocks_total"):
        assert name in used, name
    # every series a panel reads is scoped to the chosen cluster and namespace
    for p in panels(doc):
        for t in p.get("targets", ()):
            for metric, labels in SELECTOR.findall(t["expr"]):
                assert 'cluster=~"$cluster"' in labels and 'namespace=~"$namespace"' in labels, \
                    (p["title"], metric)


def test_every_metric_in_the_dashboard_and_the_rules_exists(
        families: dict[str, Any], tmp_path: Path) -> None:
    exported = exported_names(families)
    used = {m for q in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(q)}
    assert used, "the dashboard queries no spokefs metric"
    missing = sorted(used - exported)
    assert not missing, f"the dashboard asks for metrics no hub or spoke exports: {missing}"
    rules = rule_queries(render_rules({"prometheusRule": {"enabled": True}}, tmp_path, True))
    for alert, expr in rules.items():
        found = set(METRIC.findall(expr))
        assert found, alert
        if "spokefs_hub_digest_mismatches_total" in found and \
                "spokefs_hub_digest_mismatches" not in families:
            pytest.skip("the bucket hub's metrics need the s3 extra and moto")
        assert found <= exported, f"{alert} asks for metrics nothing exports: " \
            f"{sorted(found - exported)}"


def test_alert_rules_render_only_when_enabled_and_the_operator_is_there(
        tmp_path: Path) -> None:
    assert render_rules({}, tmp_path / "a", True) == []  # off by default
    # on, but the cluster lacks monitoring.coreos.com/v1: nothing that needs it
    assert render_rules({"prometheusRule": {"enabled": True}}, tmp_path / "b", False) == []
    docs = render_rules({"prometheusRule": {"enabled": True, "labels": {"release": "kps"},
                                            "hitRatioBelow": 0.3}}, tmp_path / "c", True)
    assert [(d["apiVersion"], d["kind"]) for d in docs] == [
        ("monitoring.coreos.com/v1", "PrometheusRule")]
    assert docs[0]["metadata"]["labels"]["release"] == "kps"
    rules = {r["alert"]: r for g in docs[0]["spec"]["groups"] for r in g["rules"]}
    # what the alerts must cover: link down, hit ratio, cache not writable, integrity
    for alert in ("SpokefsUpstreamLinkDown", "SpokefsHitRatioLow", "SpokefsCacheNotWritable",
                  "SpokefsIntegrityFailures"):
        assert alert in rules, alert
    assert "< 0.3" in rules["SpokefsHitRatioLow"]["expr"]
    for alert, r in rules.items():
        expr = r["expr"]
        assert r["labels"]["severity"] in ("warning", "critical"), alert
        assert r["annotations"]["summary"] and r["annotations"]["description"], alert
        for open_, close in ("()", "{}", "[]"):
            assert expr.count(open_) == expr.count(close), (alert, expr)
        for metric, labels in SELECTOR.findall(expr):  # this release's namespace only
            assert 'namespace="ml"' in labels, (alert, metric)
        assert "{{" not in expr, (alert, expr)  # no template left unrendered


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
