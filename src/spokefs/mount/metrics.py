"""The mount's own metrics: ``spokefs mount --metrics-port PORT`` serves them as Prometheus
text at ``http://ADDR:PORT/metrics`` (ADDR ``127.0.0.1`` unless ``--metrics-addr``; off by
default). Both engines export the same series:

- ``spokefs_mount_op_seconds{op}``: how long each FUSE request took to answer, by kind
  (lookup, getattr, open, opendir, read, readdir; readdirplus counts as readdir); a read
  from the kernel's request to the reply, an EIO included;
- ``spokefs_mount_eio_total``: requests answered EIO (the upstream did not answer within
  ``--deadline``, or answered an error);
- ``spokefs_mount_read_bytes_total``: bytes handed to the kernel's reads;
- ``spokefs_mount_info``: the engine, the mountpoint and what is mounted.

The python engine records with prometheus_client as each handler returns (``instrument``:
the handlers pyfuse3 calls, wrapped on the instance). The native engine records in Rust
(atomics, the same fixed buckets: native/mount/src/latency.rs), and a scrape reads it all in
one call (``Mount.metrics``), never a Python call per request.

Why an endpoint of its own rather than the counts reported to the spoke: the mount is one
process per node and volume, each scraped as its pod or node is, and its EIOs matter most
when the spoke is the thing that is down.
"""

from __future__ import annotations

import errno
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from spokefs.errors import ConfigError

log = logging.getLogger(__name__)

OPS = ("lookup", "getattr", "open", "opendir", "read", "readdir")
# Upper bounds 1 us * 2^k, k = 0..24 (1 us to 16.8 s): FUSE answers span warm metadata
# (microseconds) to a read waiting out a deadline. The native engine's, bound for bound.
BUCKETS = tuple(2 ** k / 1e6 for k in range(25))


class NativeMount(Protocol):
    def metrics(self) -> tuple[list[float], list[tuple[str, list[int], float]],
                               dict[str, int]]: ...


def make_registry(engine: str, mountpoint: str, what: str) -> CollectorRegistry:
    """A registry of this mount's own (not the process-wide default), with its info set."""
    registry = CollectorRegistry(auto_describe=True)
    Info("spokefs_mount", "What this mount serves: engine, mountpoint, dataset@snapshot "
         "(or the namespace URL)", registry=registry).info(
        {"engine": engine, "mountpoint": mountpoint, "source": what})
    return registry


class PythonMetrics:
    """The python engine's series, recorded as each FUSE handler returns."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.op_seconds = Histogram(
            "spokefs_mount_op_seconds", "Seconds the mount took to answer a FUSE request, "
            "by kind (a read from the request to the reply, an EIO included)", ["op"],
            buckets=BUCKETS, registry=registry)
        self.eio = Counter("spokefs_mount_eio", "FUSE requests answered EIO (the upstream "
                           "did not answer within --deadline, or answered an error)",
                           registry=registry)
        self.read_bytes = Counter("spokefs_mount_read_bytes", "Bytes the mount handed to "
                                  "the kernel's reads", registry=registry)

    def instrument(self, ops: object) -> None:
        """Time the handlers of ``ops`` (pyfuse3 looks each one up on the instance for
        every request, so wrappers set there see every request, subclasses' included)."""
        for op in OPS:
            setattr(ops, op, self._timed(op, getattr(ops, op)))

    def _timed(self, op: str, handler: Callable[..., Awaitable[Any]]
               ) -> Callable[..., Awaitable[Any]]:
        import pyfuse3

        hist, eio, read_bytes = self.op_seconds.labels(op), self.eio, self.read_bytes
        is_read = op == "read"

        async def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = await handler(*args)
            except pyfuse3.FUSEError as exc:
                if exc.errno == errno.EIO:
                    eio.inc()
                raise
            finally:
                hist.observe(time.perf_counter() - t0)
            if is_read:
                read_bytes.inc(len(out))
            return out

        return timed


class NativeCollector(Collector):
    """The native engine's series, read from Rust in one call per scrape."""

    def __init__(self, mount: NativeMount) -> None:
        self.mount = mount

    def collect(self) -> Iterator[Any]:
        bounds, ops, counters = self.mount.metrics()
        h = HistogramMetricFamily(
            "spokefs_mount_op_seconds", "Seconds the mount took to answer a FUSE request, "
            "by kind (a read from the request to the reply, an EIO included)", labels=["op"])
        for op, counts, total in ops:
            cum = list(itertools.accumulate(counts))  # Rust's are per bucket, +Inf last
            buckets = [(floatToGoString(b), c) for b, c in zip(bounds, cum[:-1], strict=True)]
            h.add_metric([op], [*buckets, ("+Inf", cum[-1])], total)
        yield h
        # Every EIO the native engine answers is a read's (metadata is never remote).
        yield CounterMetricFamily("spokefs_mount_eio", "FUSE requests answered EIO (the "
                                  "upstream did not answer within --deadline, or answered "
                                  "an error)", value=counters["read_errors"])
        yield CounterMetricFamily("spokefs_mount_read_bytes", "Bytes the mount handed to "
                                  "the kernel's reads", value=counters["read_bytes"])


@dataclass
class MetricsServer:
    """``/metrics`` of one mount, served from a thread (prometheus_client's server)."""

    url: str
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(registry: CollectorRegistry, addr: str, port: int | None) -> MetricsServer | None:
    """Serve ``registry`` on ``addr:port`` (port 0: any free one; None: not at all)."""
    if port is None:
        return None
    try:
        server, thread = start_http_server(port, addr, registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {addr}: "
                          f"{exc.strerror or exc}") from exc
    host, bound = server.server_address[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{bound}/metrics"
    log.info("metrics at %s", url)
    return MetricsServer(url, server, thread)


def ready_note(server: MetricsServer | None) -> str:
    """What the ready line adds: where the metrics are."""
    return f", metrics={server.url}" if server is not None else ""


def serve_python(ops: object, mountpoint: str, what: str, addr: str, port: int | None
                 ) -> MetricsServer | None:
    """The python engine's ``/metrics``, its handlers timed (only when asked for: a mount
    without ``--metrics-port`` pays nothing)."""
    if port is None:
        return None
    registry = make_registry("python", mountpoint, what)
    PythonMetrics(registry).instrument(ops)
    return serve(registry, addr, port)


def serve_native(mount: NativeMount, mountpoint: str, what: str, addr: str, port: int | None
                 ) -> MetricsServer | None:
    """The native engine's ``/metrics`` (Rust records always: a few atomics a request)."""
    if port is None:
        return None
    registry = make_registry("native", mountpoint, what)
    registry.register(NativeCollector(mount))
    return serve(registry, addr, port)
