"""Tier membership (spokefs.tier.membership): up, suspect and down from request outcomes, with a
fake clock; and the member sources (spokefs.tier.sources): static lists, DNS, EndpointSlices
(parsed, listed once, and watched against a stand-in for the API server)."""

from __future__ import annotations

import itertools
import json
import socket
import time

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
# managedFields); this parses it. The I/O (a list, a watch) runs against tests/kube_api.py
# further down.
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
    from spokefs.tier.sources import KubernetesMembers

    with pytest.raises(ConfigError, match="automountServiceAccountToken"):
        KubernetesMembers("spokefs-spoke", sa_dir=tmp_path)()  # said at once, not in a thread
    with pytest.raises(ConfigError, match="scheme"):
        KubernetesMembers("spokefs-spoke", scheme="ftp")


# -- the watch: against a stand-in for the API server ---------------------------------------------
# tests/kube_api.py stands in for the Kubernetes API server, which these tests cannot start:
# an HTTPS server on 127.0.0.1 speaking the list and watch of EndpointSlices as the API server
# does (resourceVersions, chunked watch streams, 410 for an expired version, bearer tokens).
SVC = "spokefs-spoke"


def member(host: str) -> str:
    return f"http://{host}.{SVC}.ml.svc.cluster.local:8471"


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """The stand-in API server and this 'pod's' service account pointing at it."""
    import ssl

    import trustme

    from kube_api import FakeKubeAPI

    ca = trustme.CA()
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    ca.cert_pem.write_to_path(str(sa / "ca.crt"))
    (sa / "token").write_text("token-1\n")
    (sa / "namespace").write_text("ml")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    api = FakeKubeAPI(sa, ctx)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    yield api
    api.close()


def watcher(kube, **kw):
    from spokefs.tier.sources import KubernetesMembers

    kw.setdefault("backoff_first", 0.05)
    kw.setdefault("backoff_cap", 0.2)
    return KubernetesMembers(SVC, port=8471, sa_dir=kube.sa_dir, timeout=10.0, **kw)


def wait_members(w, want, timeout=10.0):
    """Wait (with a deadline) until the watch reports ``want``."""
    end = time.monotonic() + timeout
    seen = 0
    while w.members != want:
        left = end - time.monotonic()
        assert left > 0, f"members {w.members}, wanted {want} (error: {w.error})"
        seen = w.wait_changed(seen, left)
    return w.members


def test_watch_members_appear_and_leave_as_the_watch_reports_them(kube):
    from kube_api import endpoint_slice

    kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True), ("spoke-1", True)]))
    kube.put(endpoint_slice("other", "other", [("x-0", True)]))  # another service's
    w = watcher(kube)
    try:
        assert w() == [member("spoke-0"), member("spoke-1")]
        kube.wait_watching()
        (listed,) = [r for r in kube.requests if not r["watch"]]
        # One pod more in the slice, one not ready: the list follows.
        kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True), ("spoke-1", False),
                                             ("spoke-2", True)]))
        wait_members(w, [member("spoke-0"), member("spoke-2")])
        kube.put(endpoint_slice("s-b", SVC, [("spoke-3", True)]))  # a new slice
        wait_members(w, [member("spoke-0"), member("spoke-2"), member("spoke-3")])
        kube.delete("s-a")
        wait_members(w, [member("spoke-3")])
        assert w() == [member("spoke-3")] and w.error is None
        # All of it from one list and its watch, resumed from the list's version.
        assert w.lists == 1
        watches = [r for r in kube.requests if r["watch"]]
        assert watches and watches[0]["resourceVersion"] is not None
        assert int(watches[0]["resourceVersion"]) >= 1000 and listed["token_ok"]
    finally:
        w.close()


def test_watch_expired_410_lists_again_and_finds_what_it_missed(kube):
    from kube_api import endpoint_slice

    kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True)]))
    kube.put(endpoint_slice("s-b", SVC, [("spoke-1", True)]))
    w = watcher(kube)
    try:
        assert w() == [member("spoke-0"), member("spoke-1")]
        kube.wait_watching()
        # A deletion the watch never hears of, then the watch cache moves on: only a fresh
        # list can tell that spoke-1 is gone (resuming the watch would keep it forever).
        kube.forget("s-b")
        kube.expire()
        wait_members(w, [member("spoke-0")])
        assert w.lists == 2 and w.error is None
        kube.wait_watching()
        kube.put(endpoint_slice("s-c", SVC, [("spoke-2", True)]))  # and it watches again
        wait_members(w, [member("spoke-0"), member("spoke-2")])
    finally:
        w.close()


def test_watch_dropped_connection_reconnects_with_a_rotated_token(kube):
    from kube_api import endpoint_slice

    kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True)]))
    w = watcher(kube)
    try:
        assert w() == [member("spoke-0")]
        kube.wait_watching()
        (kube.sa_dir / "token").write_text("token-2\n")  # the kubelet rotates the token
        kube.drop()  # cut mid-stream: no end of the chunked body
        kube.put(endpoint_slice("s-b", SVC, [("spoke-1", True)]))
        wait_members(w, [member("spoke-0"), member("spoke-1")])
        assert w.error is None and w.lists >= 2
        last = kube.requests[-1]
        assert last["token_ok"]  # the new token, read again from the file
        kube.wait_watching()
        kube.delete("s-a")
        wait_members(w, [member("spoke-1")])
    finally:
        w.close()


def test_watch_failures_back_off_and_the_look_up_says_why(kube):
    from kube_api import endpoint_slice

    kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True)]))
    kube.fail(4)
    w = watcher(kube, backoff_first=0.2, backoff_cap=5.0)
    w.timeout = 0.1
    try:
        with pytest.raises(OSError, match="500"):
            w()  # not in step with the API server: the caller keeps its last list
        w.timeout = 10.0
        assert w() == [member("spoke-0")]
        times = [r["time"] for r in kube.requests if not r["watch"]][:5]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # Pauses of 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6 s: each retry waits longer.
        assert len(gaps) == 4 and gaps[0] >= 0.1 and gaps[3] > gaps[0] + 0.4, gaps
    finally:
        w.close()


def test_one_shot_list_against_the_api(kube):
    from kube_api import endpoint_slice

    kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True), ("spoke-1", False)]))
    assert kubernetes_members(SVC, port=8471, sa_dir=kube.sa_dir) == [member("spoke-0")]
    kube.fail(1)
    with pytest.raises(OSError, match="500"):
        kubernetes_members(SVC, port=8471, sa_dir=kube.sa_dir)


def test_the_tier_follows_the_watch_and_keeps_its_list_while_the_api_is_away(kube):
    """The spoke's refresh loop (spokefs.spoke.tier.Tier) with the watch as its look-up: the
    list follows the watch; while the API server fails, the last list stays and the status
    says why; once it answers again, the error clears."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from kube_api import endpoint_slice
    from spokefs.spoke.tier import Tier

    me = member("spoke-0")
    kube.put(endpoint_slice("s-a", SVC, [("spoke-0", True), ("spoke-1", True)]))
    w = watcher(kube, backoff_first=0.5, backoff_cap=0.5)
    w.timeout = 0.2  # how long a look-up waits for a watch out of step

    async def until(check, what: str) -> None:
        end = time.monotonic() + 15
        while not check():
            assert time.monotonic() < end, what
            await asyncio.sleep(0.02)

    async def main() -> None:
        tier = Tier(me, [me], CollectorRegistry(), token=None, lookup=w, source="kubernetes",
                    refresh=0.05)
        task = asyncio.create_task(tier.refresh_loop())
        try:
            await until(lambda: tier.router.members == [me, member("spoke-1")], "first list")
            await asyncio.to_thread(kube.wait_watching)
            kube.fail(1000)
            kube.drop()
            await until(lambda: tier.status()["refresh_error"] is not None, "an error shown")
            assert "Kubernetes API" in str(tier.status()["refresh_error"])  # the cut, the 500s
            assert tier.router.members == [me, member("spoke-1")]  # the last list, kept
            kube.fail(0)
            kube.delete("s-a")
            kube.put(endpoint_slice("s-b", SVC, [("spoke-0", True), ("spoke-2", True)]))
            await until(lambda: tier.router.members == [me, member("spoke-2")], "relisted")
            await until(lambda: tier.status()["refresh_error"] is None, "the error cleared")
        finally:
            task.cancel()
            await tier.close()

    try:
        asyncio.run(main())
    finally:
        w.close()
