"""Where the member list comes from: a static list, DNS, or the Kubernetes EndpointSlice API.

Each source is a pure parser (tested without a network) and, for DNS and Kubernetes, a thin
synchronous look-up around it that a driver calls every few seconds (in a thread, off the event
loop). A look-up that fails raises; the driver keeps the last list it had, since a tier that
forgot its members on one failed look-up would move every share at once.

- Static (``--tier URL,URL,...``): the list as given.
- DNS (``--tier-dns NAME``): the A/AAAA records of NAME, e.g. a Kubernetes headless Service;
  members are named by IP, so ``--advertise`` must be this member's own IP URL.
- Kubernetes (``--tier-kubernetes SERVICE``): the EndpointSlices of SERVICE in this pod's
  namespace, ready endpoints only. An endpoint with a hostname (a StatefulSet pod behind its
  governing headless Service) is named by its stable DNS name,
  ``HOSTNAME.SERVICE.NAMESPACE.svc.CLUSTER_DOMAIN``, so a replaced pod keeps its identity and
  its share of the keys; others by IP.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from spokefs.errors import ConfigError
from spokefs.tier.rendezvous import normalise_url

__all__ = ["SERVICE_ACCOUNT_DIR", "fetch_endpointslices", "kubernetes_members",
           "members_from_addresses", "members_from_endpointslices", "parse_static",
           "resolve_dns"]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def _host_url(scheme: str, host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name, not an address
    return normalise_url(f"{scheme}://{host}:{port}")


def _check_scheme(scheme: str) -> str:
    if scheme not in ("http", "https"):
        raise ConfigError(f"tier scheme must be http or https, not {scheme!r}")
    return scheme


# -- static -------------------------------------------------------------------------------------

def parse_static(text: str) -> list[str]:
    """``URL,URL,...`` (spaces allowed) to sorted, normalised, distinct member names."""
    urls = [u for u in (part.strip() for part in text.split(",")) if u]
    if not urls:
        raise ConfigError("--tier needs at least one URL")
    return sorted({normalise_url(u) for u in urls})


# -- DNS ----------------------------------------------------------------------------------------

def members_from_addresses(addresses: Iterable[str], scheme: str, port: int) -> list[str]:
    """Member names for IP addresses (as DNS gives them), sorted and distinct."""
    _check_scheme(scheme)
    return sorted({_host_url(scheme, a, port) for a in addresses})


def resolve_dns(name: str, port: int, scheme: str = "http") -> list[str]:
    """The members behind DNS ``name``: one per address it resolves to. OSError (socket.gaierror)
    when it does not resolve."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    # sockaddr[0] is the address for both families; IPv6 scope ids are not member names.
    return members_from_addresses((str(info[4][0]).split("%")[0] for info in infos),
                                  scheme, port)


# -- Kubernetes ---------------------------------------------------------------------------------

def _slice_port(slice_: Mapping[str, Any], port_name: str | None) -> int | None:
    ports = slice_.get("ports") or []
    for p in ports:
        if (port_name is None or p.get("name") == port_name) and isinstance(p.get("port"), int):
            return int(p["port"])
    return None


def members_from_endpointslices(doc: Mapping[str, Any], *, service: str, namespace: str,
                                scheme: str = "http", port_name: str | None = None,
                                port: int | None = None,
                                cluster_domain: str = "cluster.local") -> list[str]:
    """Member names from an ``EndpointSliceList`` (``GET .../endpointslices``).

    Only ready endpoints count: ``conditions.ready`` true, or absent (the API says to read
    "unknown" as ready), and not ``terminating``. The port is the slice's port named
    ``port_name`` (or its first), else ``port``. A slice of another service is ignored.
    """
    _check_scheme(scheme)
    if doc.get("kind") not in (None, "EndpointSliceList"):
        raise ConfigError(f"expected an EndpointSliceList, got {doc.get('kind')!r}")
    out: set[str] = set()
    for slice_ in doc.get("items") or []:
        labels = (slice_.get("metadata") or {}).get("labels") or {}
        if labels.get("kubernetes.io/service-name", service) != service:
            continue
        if slice_.get("addressType") not in (None, "IPv4", "IPv6", "FQDN"):
            continue
        p = _slice_port(slice_, port_name) or port
        if p is None:
            continue
        for ep in slice_.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            hostname = ep.get("hostname")
            if hostname:
                host = f"{hostname}.{service}.{namespace}.svc.{cluster_domain}"
            elif ep.get("addresses"):
                host = ep["addresses"][0]
            else:
                continue
            out.add(_host_url(scheme, host, p))
    return sorted(out)


def _in_cluster(sa_dir: Path) -> tuple[str, str, str]:
    """(API server base URL, token, namespace) from the standard in-cluster paths."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("--tier-kubernetes: not running in a Kubernetes pod "
                          "(KUBERNETES_SERVICE_HOST is not set)")
    try:
        token = (sa_dir / "token").read_text().strip()  # re-read: projected tokens rotate
        namespace = (sa_dir / "namespace").read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--tier-kubernetes: cannot read the service account in {sa_dir} "
                          f"({exc}); is automountServiceAccountToken off?") from exc
    if ":" in host:  # an IPv6 service address
        host = f"[{host}]"
    return f"https://{host}:{port}", token, namespace


def fetch_endpointslices(service: str, *, namespace: str | None = None, timeout: float = 5.0,
                         sa_dir: Path = SERVICE_ACCOUNT_DIR) -> tuple[dict[str, Any], str]:
    """GET the EndpointSlices of ``service`` from the API server, with this pod's service
    account (RBAC: get/list on endpointslices.discovery.k8s.io). Returns (document,
    namespace). OSError or ConfigError on failure."""
    base, token, own_namespace = _in_cluster(sa_dir)
    ns = namespace or own_namespace
    selector = urllib.parse.quote(f"kubernetes.io/service-name={service}", safe="")
    url = (f"{base}/apis/discovery.k8s.io/v1/namespaces/{urllib.parse.quote(ns, safe='')}"
           f"/endpointslices?labelSelector={selector}")
    ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                               "Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
        return json.loads(resp.read()), ns


def kubernetes_members(service: str, *, scheme: str = "http", port_name: str | None = None,
                       port: int | None = None, namespace: str | None = None,
                       cluster_domain: str = "cluster.local", timeout: float = 5.0,
                       sa_dir: Path = SERVICE_ACCOUNT_DIR) -> list[str]:
    """The ready members of ``service``, looked up in the API server."""
    doc, ns = fetch_endpointslices(service, namespace=namespace, timeout=timeout,
                                   sa_dir=sa_dir)
    return members_from_endpointslices(doc, service=service, namespace=ns, scheme=scheme,
                                       port_name=port_name, port=port,
                                       cluster_domain=cluster_domain)
