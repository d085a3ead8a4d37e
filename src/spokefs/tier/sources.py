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
  its share of the keys; others by IP. ``KubernetesMembers`` keeps the list by a list and then
  a watch of those slices (lightkube, in a thread of its own), as client-go's reflector does:
  a watch that ends is resumed from the last resourceVersion seen, one the API server has
  expired (410 Gone) is replaced by a fresh list, a failed connection is retried with
  backoff. Looking up the list is then a read of memory: no request per refresh.
  ``kubernetes_members`` is the one-shot list.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spokefs.errors import ConfigError
from spokefs.tier.rendezvous import normalise_url

if TYPE_CHECKING:
    from lightkube import Client

__all__ = ["SERVICE_ACCOUNT_DIR", "KubernetesMembers", "fetch_endpointslices",
           "kubernetes_members", "members_from_addresses", "members_from_endpointslices",
           "parse_static", "resolve_dns"]

log = logging.getLogger(__name__)

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


SERVICE_LABEL = "kubernetes.io/service-name"


def _in_cluster(sa_dir: Path) -> tuple[str, str]:
    """This pod's API server and namespace: (base URL, namespace), or a ConfigError that
    says what is missing."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("--tier-kubernetes: not running in a Kubernetes pod "
                          "(KUBERNETES_SERVICE_HOST is not set)")
    try:
        (sa_dir / "token").read_text()
        namespace = (sa_dir / "namespace").read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--tier-kubernetes: cannot read the service account in {sa_dir} "
                          f"({exc}); is automountServiceAccountToken off?") from exc
    if ":" in host:  # an IPv6 service address
        host = f"[{host}]"
    return f"https://{host}:{port}", namespace


def _client(sa_dir: Path, timeout: float) -> Client:
    """A lightkube client with this pod's service account (the token file is read again for
    each request: projected tokens rotate). Its connections have TCP keepalive on: a watch
    has no read timeout, so a peer gone without a word is found by the kernel."""
    import httpx2
    from lightkube import Client, KubeConfig
    from lightkube.config.models import Cluster, User

    base, namespace = _in_cluster(sa_dir)
    ca = str(sa_dir / "ca.crt")
    config = KubeConfig.from_one(cluster=Cluster(server=base, certificate_auth=ca),
                                 user=User(token_file=str(sa_dir / "token")),
                                 namespace=namespace)
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux: 30 s idle, then 3 probes 10 s apart
        opts += [(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30),
                 (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10),
                 (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)]
    transport = httpx2.HTTPTransport(verify=ssl.create_default_context(cafile=ca),
                                     socket_options=opts)
    return Client(config, namespace=namespace, timeout=httpx2.Timeout(timeout),
                  transport=transport, trust_env=False)


def _list(client: Client, service: str, namespace: str | None
          ) -> tuple[list[dict[str, Any]], str]:
    """The EndpointSlices of ``service`` (as the API's JSON) and the list's resourceVersion."""
    from lightkube.core.exceptions import NotReadyError
    from lightkube.resources.discovery_v1 import EndpointSlice

    found = client.list(EndpointSlice, namespace=namespace, labels={SERVICE_LABEL: service})
    items = [s.to_dict() for s in found]
    try:
        version = found.resourceVersion
    except NotReadyError as exc:  # no resourceVersion in the answer: nothing to watch from
        raise OSError(f"the EndpointSlice list has no resourceVersion ({exc})") from exc
    return items, version


def fetch_endpointslices(service: str, *, namespace: str | None = None, timeout: float = 5.0,
                         sa_dir: Path = SERVICE_ACCOUNT_DIR) -> tuple[dict[str, Any], str]:
    """GET the EndpointSlices of ``service`` from the API server, with this pod's service
    account (RBAC: list on endpointslices.discovery.k8s.io). Returns (an EndpointSliceList
    document, namespace). OSError or ConfigError on failure."""
    client = _client(sa_dir, timeout)
    try:
        ns = namespace or client.namespace
        items, version = _call(lambda: _list(client, service, ns))
    finally:
        client.close()
    return {"kind": "EndpointSliceList", "metadata": {"resourceVersion": version},
            "items": items}, ns


def _call(fn: Any) -> Any:
    """``fn()`` with lightkube's and httpx's errors as OSError (what a look-up raises)."""
    import httpx2

    try:
        return fn()
    except httpx2.HTTPError as exc:
        raise OSError(_why(exc)) from exc


def _why(exc: BaseException) -> str:
    code = _status(exc)
    text = str(exc) or type(exc).__name__
    return f"Kubernetes API: {code} {text}" if code else f"Kubernetes API: {text}"


def _status(exc: BaseException) -> int | None:
    """The HTTP status of an API error (an ERROR event's Status counts too), else None."""
    status = getattr(exc, "status", None)
    if getattr(status, "code", None) is not None:
        return int(status.code)
    try:
        response = getattr(exc, "response", None)
        return int(response.status_code) if response is not None else None
    except (AttributeError, RuntimeError):  # httpx: an error raised without a response
        return None


def kubernetes_members(service: str, *, scheme: str = "http", port_name: str | None = None,
                       port: int | None = None, namespace: str | None = None,
                       cluster_domain: str = "cluster.local", timeout: float = 5.0,
                       sa_dir: Path = SERVICE_ACCOUNT_DIR) -> list[str]:
    """The ready members of ``service``, listed once in the API server."""
    doc, ns = fetch_endpointslices(service, namespace=namespace, timeout=timeout,
                                   sa_dir=sa_dir)
    return members_from_endpointslices(doc, service=service, namespace=ns, scheme=scheme,
                                       port_name=port_name, port=port,
                                       cluster_domain=cluster_domain)


class KubernetesMembers:
    """The ready members of ``service``, kept up to date by a watch of its EndpointSlices.

    Calling it is a look-up (what ``spokefs.spoke.tier.Tier`` calls every ``--tier-refresh``):
    it starts the watch on the first call, waits up to ``timeout`` for the first list, and
    returns the members as the watch last reported them. While the watch is not in step
    with the API server (the first list not in yet, a connection being retried) it raises
    OSError saying why, so the caller keeps its last list and shows the error, as it does for
    a failed one-shot look-up. ``wait_changed`` blocks until the list changes (for a caller
    that reacts to changes rather than polls, and for tests).

    The loop, in a daemon thread: list the slices (their resourceVersion), then watch from
    that version; each event updates the slices. A watch the server ends (its
    ``server_timeout``) is resumed by lightkube from the last version. A watch that fails
    (connection refused, reset, cut mid-stream, a 5xx) is resumed from the last version after
    a backoff pause (``backoff_first`` doubling to ``backoff_cap``, jittered); a version the
    server has expired (410 Gone: the watch cache moved on while we were away) makes a fresh
    list, since events in between (a deletion) are lost for good.

    RBAC: list and watch on endpointslices.discovery.k8s.io in the namespace.
    """

    def __init__(self, service: str, *, scheme: str = "http", port_name: str | None = None,
                 port: int | None = None, namespace: str | None = None,
                 cluster_domain: str = "cluster.local", timeout: float = 5.0,
                 server_timeout: int = 300, backoff_first: float = 0.5,
                 backoff_cap: float = 30.0, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> None:
        _check_scheme(scheme)
        if not service:
            raise ConfigError("--tier-kubernetes needs a Service name")
        if timeout <= 0 or server_timeout < 1 or not 0 < backoff_first <= backoff_cap:
            raise ConfigError("timeout, server_timeout and backoff must be positive, "
                              "backoff_first <= backoff_cap")
        self.service = service
        self.scheme, self.port_name, self.port = scheme, port_name, port
        self.namespace = namespace
        self.cluster_domain = cluster_domain
        self.timeout = timeout
        self.server_timeout = server_timeout
        self.backoff_first, self.backoff_cap = backoff_first, backoff_cap
        self.sa_dir = sa_dir
        self._cond = threading.Condition()
        self._slices: dict[str, dict[str, Any]] = {}   # by name, as the API gives them
        self._members: list[str] = []
        self._version = 0                # bumped on each change of _members
        self._in_step = False            # listed and watching, no failure since
        self._error: str | None = "the first list is not in yet"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.lists = 0                   # how many times the slices were listed (relists)

    # -- what callers see ------------------------------------------------------------------

    def __call__(self) -> list[str]:
        self.start()
        with self._cond:
            self._cond.wait_for(lambda: self._in_step or self._stop.is_set(), self.timeout)
            if not self._in_step:
                raise OSError(f"--tier-kubernetes {self.service}: {self._error}")
            return list(self._members)

    @property
    def members(self) -> list[str]:
        """The members as last seen (whether or not the watch is in step now)."""
        with self._cond:
            return list(self._members)

    @property
    def error(self) -> str | None:
        """Why the watch is not in step with the API server (None: it is)."""
        with self._cond:
            return None if self._in_step else self._error

    def wait_changed(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for the list to differ from version ``seen`` (0: never
        seen); returns the version now."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen or self._stop.is_set(), timeout)
            return self._version

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                _in_cluster(self.sa_dir)  # a clear error now, not in the thread
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"tier-watch-{self.service}")
                self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stop watching; the thread ends at the watch's next event or end (it is a daemon:
        it never holds up the process)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and timeout is not None:
            self._thread.join(timeout)

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        from spokefs.retry import forever

        policy = forever(self.backoff_first, self.backoff_cap)
        pauses = policy.delays()
        while not self._stop.is_set():
            client: Client | None = None
            try:
                client = _client(self.sa_dir, self.timeout)
                namespace = self.namespace or client.namespace
                items, version = _list(client, self.service, namespace)
                self._replace(items, namespace)
                pauses = policy.delays()
                self._watch(client, namespace, version)
            except Exception as exc:  # whatever the API or the network did: never end
                if _status(exc) == 410:  # expired: events in between are lost; list again
                    log.info("tier: the EndpointSlice watch of %s expired (410 Gone); "
                             "listing again", self.service,
                             extra={"event": "tier_watch_expired"})
                    continue
                self._failed(_why(exc))
                self._stop.wait(next(pauses))
            finally:
                if client is not None:
                    client.close()

    def _watch(self, client: Client, namespace: str, version: str) -> None:
        """Apply watch events from ``version`` on until told to stop or the watch fails
        (raises). lightkube resumes a watch the server ends from the last version seen."""
        from lightkube.resources.discovery_v1 import EndpointSlice

        events = client.watch(EndpointSlice, namespace=namespace,
                              labels={SERVICE_LABEL: self.service},
                              server_timeout=self.server_timeout, resource_version=version)
        for kind, obj in events:
            if self._stop.is_set():
                break
            meta = obj.metadata
            if kind == "BOOKMARK" or meta is None or not meta.name:
                continue
            with self._cond:
                if kind == "DELETED":
                    self._slices.pop(meta.name, None)
                else:  # ADDED, MODIFIED
                    self._slices[meta.name] = obj.to_dict()
                self._publish(namespace)

    # -- state (under the lock) ------------------------------------------------------------

    def _replace(self, items: list[dict[str, Any]], namespace: str) -> None:
        with self._cond:
            self.lists += 1
            self._slices = {(i.get("metadata") or {}).get("name", ""): i for i in items}
            self._in_step, self._error = True, None
            self._publish(namespace)

    def _publish(self, namespace: str) -> None:
        members = members_from_endpointslices(
            {"items": list(self._slices.values())}, service=self.service,
            namespace=namespace, scheme=self.scheme, port_name=self.port_name,
            port=self.port, cluster_domain=self.cluster_domain)
        if members != self._members:
            self._members = members
            self._version += 1
        self._cond.notify_all()

    def _failed(self, why: str) -> None:
        with self._cond:
            was = self._in_step
            self._in_step, self._error = False, why
            self._cond.notify_all()
        if was:
            log.warning("tier: the EndpointSlice watch of %s failed (%s); retrying with "
                        "backoff, the last list kept", self.service, why,
                        extra={"event": "tier_watch_failed"})
