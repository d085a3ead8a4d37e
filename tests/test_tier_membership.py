"""Tier membership (spokefs.tier.membership): up, suspect and down from request outcomes, with a
fake clock; and the member sources (spokefs.tier.sources): static lists, DNS, EndpointSlices."""

from __future__ import annotations

import json
import socket

import pytest

from spokefs.errors import ConfigError
from spokefs.tier.membership import Membership, State
from spokefs.tier.rendezvous import Rendezvous
from spokefs.tier.sources import (
    kubernetes_members,
    members_from_addresses,
    members_from_endpointslices,
    parse_static,
    resolve_dns,
)

A, B, C = "http://a:8471", "http://b:8471", "http://c:8471"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self, dt: float = 0.0) -> float:
        self.t += dt
        return self.t


def test_a_member_that_stops_answering_is_skipped_within_the_deadline_and_taken_back():
    now = Clock()
    m = Membership([A, B, C], now(), self_url=A, down_failures=3, down_after=5.0,
                   retry_after=1.0, retry_max=8.0)
    assert all(m.state(u, now()) is State.UP for u in (A, B, C))
    m.timed_out(B, now(0.1))
    assert m.state(B, now()) is State.SUSPECT
    assert m.candidates([B, C, A], now()) == [B, C, A]  # suspect: still asked
    # no answer for down_after since the first failure: down, skipped
    assert m.state(B, now(4.9)) is State.SUSPECT
    assert m.state(B, now(0.2)) is State.DOWN
    assert m.candidates([B, C, A], now()) == [C, A]
    m.timed_out(B, now(0.5))  # a request sent before it went down: no change to the probes
    # probes at growing intervals while it stays down, each handed out once
    assert m.probes_due(now()) == []
    assert m.probes_due(now(0.5)) == [B]
    assert m.probes_due(now()) == []  # in flight
    m.failed(B, now(0.1))
    assert m.probes_due(now(1.5)) == []
    assert m.probes_due(now(0.6)) == [B]  # 2 s after the failed probe
    m.timed_out(B, now())
    assert m.next_deadline(now()) == pytest.approx(now() + 4.0)
    # it answers: up at once, in the candidates again
    m.answered(B, now(4.0))
    assert m.state(B, now()) is State.UP
    assert m.candidates([B, C, A], now()) == [B, C, A]
    assert m.health(B).failures == 0


def test_repeated_failures_mark_a_member_down_before_the_deadline():
    now = Clock()
    m = Membership([A, B], now(), down_failures=3, down_after=60.0)
    m.failed(A, now(0.01))
    m.failed(A, now(0.01))
    assert m.state(A, now()) is State.SUSPECT
    m.failed(A, now(0.01))
    assert m.state(A, now()) is State.DOWN
    assert m.next_deadline(now()) == pytest.approx(now() + 1.0)


def test_an_answer_clears_a_suspect_member():
    now = Clock()
    m = Membership([A, B], now(), down_after=5.0)
    m.failed(A, now(1.0))
    m.answered(A, now(1.0))
    m.failed(A, now(4.5))  # a new first failure: the clock starts again
    assert m.state(A, now(4.0)) is State.SUSPECT
    assert m.state(A, now(1.0)) is State.DOWN


def test_self_is_never_down_and_always_listed():
    now = Clock()
    m = Membership([B, C], now(), self_url=A, down_failures=1)
    assert A in m.members
    m.failed(A, now())
    assert m.state(A, now()) is State.UP


def test_update_keeps_health_of_kept_members_and_ownership_uses_the_whole_list():
    now = Clock()
    m = Membership([A, B, C], now(), down_failures=1)
    m.failed(C, now())
    assert m.update([A, C, "http://d:8471/"], now()) == (["http://d:8471"], [B])
    assert m.state(C, now()) is State.DOWN  # a refresh does not forgive a down member
    ring = Rendezvous(m.members)  # ranking over every listed member, down or not
    assert set(ring.members) == {A, C, "http://d:8471"}
    for i in range(200):
        ranked = ring.ranked("0f" * 16, i)
        assert C not in m.candidates(ranked, now())
    rows = m.snapshot(now(), ring.shares())
    assert [r["state"] for r in rows] == ["up", "down", "up"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert m.health(B) is None
    m.answered(B, now())  # an outcome from a member no longer listed is ignored


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError):
        Membership([A], 0.0, down_failures=0)
    with pytest.raises(ConfigError):
        Membership([A], 0.0, retry_after=10.0, retry_max=1.0)


# -- sources --------------------------------------------------------------------------------

def test_static_list():
    assert parse_static(" http://b:8471, HTTP://a:8471/ ,http://b:8471,") == [A, B]
    with pytest.raises(ConfigError):
        parse_static(" , ")
    with pytest.raises(ConfigError):
        parse_static("a:8471")


def test_addresses_to_members():
    assert members_from_addresses(["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::5"],
                                  "https", 8471) == [
        "https://10.0.0.1:8471", "https://10.0.0.2:8471", "https://[fd00::5]:8471"]
    with pytest.raises(ConfigError):
        members_from_addresses(["10.0.0.1"], "ftp", 1)


def test_dns_resolves_localhost():
    members = resolve_dns("localhost", 8471)
    assert members and set(members) <= {"http://127.0.0.1:8471", "http://[::1]:8471"}
    with pytest.raises(OSError):
        resolve_dns("no-such-host.invalid", 8471)


# What `GET /apis/discovery.k8s.io/v1/namespaces/ml/endpointslices?labelSelector=
# kubernetes.io/service-name=spokefs-spoke` returns for a StatefulSet of three spokes behind
# their headless Service, one of them not ready and one terminating (trimmed of
# managedFields). The API server itself is something we cannot start here, so the I/O part
# (sources.fetch_endpointslices) is not run by the tests; this parses its answer.
ENDPOINTSLICES = json.loads("""
{
  "kind": "EndpointSliceList",
  "apiVersion": "discovery.k8s.io/v1",
  "metadata": {"resourceVersion": "81723"},
  "items": [
    {
      "metadata": {
        "name": "spokefs-spoke-x7k2p",
        "namespace": "ml",
        "labels": {
          "app.kubernetes.io/name": "spokefs",
          "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
          "kubernetes.io/service-name": "spokefs-spoke",
          "service.kubernetes.io/headless": ""
        },
        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "spokefs-spoke",
                             "uid": "4f0c6f0e-1a0b-4a52-9a38-0d1c9f0e2b11",
                             "controller": true, "blockOwnerDeletion": true}]
      },
      "addressType": "IPv4",
      "endpoints": [
        {"addresses": ["10.1.4.17"],
         "conditions": {"ready": true, "serving": true, "terminating": false},
         "hostname": "spokefs-spoke-0",
         "targetRef": {"kind": "Pod", "namespace": "ml", "name": "spokefs-spoke-0",
                       "uid": "0a4d2c7e-9b1f-4a7e-8f0e-2f1c3b4d5e6f"},
         "nodeName": "ip-10-1-4-200.ec2.internal", "zone": "us-east-1a"},
        {"addresses": ["10.1.5.23"],
         "conditions": {"ready": true, "serving": true, "terminating": false},
         "hostname": "spokefs-spoke-1",
         "targetRef": {"kind": "Pod", "namespace": "ml", "name": "spokefs-spoke-1",
                       "uid": "1b5e3d8f-0c2a-4b8f-9a1f-3a2d4c5e6f70"},
         "nodeName": "ip-10-1-5-31.ec2.internal", "zone": "us-east-1b"},
        {"addresses": ["10.1.6.9"],
         "conditions": {"ready": false, "serving": false, "terminating": false},
         "hostname": "spokefs-spoke-2",
         "targetRef": {"kind": "Pod", "namespace": "ml", "name": "spokefs-spoke-2",
                       "uid": "2c6f4e90-1d3b-4c90-8b2a-4b3e5d6f7081"},
         "nodeName": "ip-10-1-6-12.ec2.internal", "zone": "us-east-1c"},
        {"addresses": ["10.1.6.44"],
         "conditions": {"ready": false, "serving": true, "terminating": true},
         "hostname": "spokefs-spoke-3",
         "targetRef": {"kind": "Pod", "namespace": "ml", "name": "spokefs-spoke-3",
                       "uid": "3d7a5fa1-2e4c-4da1-9c3b-5c4f6e708192"},
         "nodeName": "ip-10-1-6-12.ec2.internal", "zone": "us-east-1c"}
      ],
      "ports": [{"name": "http", "protocol": "TCP", "port": 8471}]
    },
    {
      "metadata": {"name": "spokefs-spoke-q9m4d", "namespace": "ml",
                   "labels": {"kubernetes.io/service-name": "spokefs-spoke"}},
      "addressType": "IPv4",
      "endpoints": [
        {"addresses": ["10.1.7.5"], "conditions": {},
         "targetRef": {"kind": "Pod", "namespace": "ml", "name": "spoke-extra"}}
      ],
      "ports": [{"name": "http", "protocol": "TCP", "port": 8471}]
    },
    {
      "metadata": {"name": "other-abcde", "namespace": "ml",
                   "labels": {"kubernetes.io/service-name": "other"}},
      "addressType": "IPv4",
      "endpoints": [{"addresses": ["10.1.9.9"], "conditions": {"ready": true}}],
      "ports": [{"name": "http", "protocol": "TCP", "port": 8471}]
    }
  ]
}
""")


def test_endpointslices_to_members_honour_ready():
    members = members_from_endpointslices(ENDPOINTSLICES, service="spokefs-spoke",
                                          namespace="ml", scheme="https", port_name="http")
    assert members == [
        "https://10.1.7.5:8471",  # ready unknown reads as ready; no hostname: by IP
        "https://spokefs-spoke-0.spokefs-spoke.ml.svc.cluster.local:8471",
        "https://spokefs-spoke-1.spokefs-spoke.ml.svc.cluster.local:8471",
    ]


def test_endpointslices_port_fallback_and_wrong_documents():
    doc = {"kind": "EndpointSliceList", "items": [
        {"metadata": {"labels": {"kubernetes.io/service-name": "s"}}, "addressType": "IPv6",
         "endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": True}}]}]}
    assert members_from_endpointslices(doc, service="s", namespace="n", port=9000) == [
        "http://[fd00::7]:9000"]
    assert members_from_endpointslices(doc, service="s", namespace="n") == []  # no port
    with pytest.raises(ConfigError):
        members_from_endpointslices({"kind": "PodList", "items": []}, service="s",
                                    namespace="n")


def test_resolve_dns_uses_getaddrinfo(monkeypatch):
    def fake(host, port, family=0, type=0, proto=0, flags=0):
        assert (host, port) == ("spokefs-spoke.ml.svc.cluster.local", 8471)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.5.23", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.4.17", port)),
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fe80::1%eth0", port, 0, 2))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert resolve_dns("spokefs-spoke.ml.svc.cluster.local", 8471) == [
        "http://10.1.4.17:8471", "http://10.1.5.23:8471", "http://[fe80::1]:8471"]


def test_kubernetes_lookup_outside_a_pod_says_why(monkeypatch, tmp_path):
    # Only the failure paths: the API server is not something these tests can start.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="not running in a Kubernetes pod"):
        kubernetes_members("spokefs-spoke", sa_dir=tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.100.0.1")
    with pytest.raises(ConfigError, match="automountServiceAccountToken"):
        kubernetes_members("spokefs-spoke", sa_dir=tmp_path)
