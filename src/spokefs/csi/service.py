"""The CSI Identity and Node services over gRPC (grpcio) on a unix socket.

The handlers are registered by hand from ``messages.SERVICES`` (no generated ``_grpc``
module): each call decodes its ``METHODRequest``, runs a plain method of ``NodeDriver`` and
encodes its ``METHODResponse``. A ``CsiError`` becomes its gRPC status with the message;
anything else is INTERNAL. ``CsiClient`` is the same table seen from the other side, for tests
and for checking a running driver.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from spokefs.csi import messages as m
from spokefs.csi.volumes import CsiError, InvalidArgument, Volumes, parse_request

log = logging.getLogger(__name__)

DRIVER_NAME = "csi.spokefs.io"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spokefs")
    except PackageNotFoundError:
        return "0+unknown"


class NodeDriver:
    """What each CSI call does; ``Volumes`` holds the mounts."""

    def __init__(self, volumes: Volumes, node_id: str, name: str = DRIVER_NAME) -> None:
        self.volumes = volumes
        self.node_id = node_id
        self.name = name
        self.ready = threading.Event()  # set once the previous driver's volumes are back

    # Identity
    def GetPluginInfo(self, req: Any) -> Any:
        return m.GetPluginInfoResponse(name=self.name, vendor_version=_version())

    def GetPluginCapabilities(self, req: Any) -> Any:
        return m.GetPluginCapabilitiesResponse()  # a node service only: no controller

    def Probe(self, req: Any) -> Any:
        resp = m.ProbeResponse()
        resp.ready.value = self.ready.is_set()
        return resp

    # Node
    def NodeGetCapabilities(self, req: Any) -> Any:
        return m.NodeGetCapabilitiesResponse()  # no staging, no stats: publish and unpublish

    def NodeGetInfo(self, req: Any) -> Any:
        return m.NodeGetInfoResponse(node_id=self.node_id)

    def NodePublishVolume(self, req: Any) -> Any:
        cap = req.volume_capability
        spec = parse_request(req.volume_id, req.target_path, req.volume_context, req.secrets,
                             block=cap.HasField("block"),
                             mount_flags=list(cap.mount.mount_flags),
                             default_spoke=self.volumes.default_spoke,
                             capability=req.HasField("volume_capability"))
        pod = req.volume_context.get("csi.storage.k8s.io/pod.name")
        ns = req.volume_context.get("csi.storage.k8s.io/pod.namespace")
        started = self.volumes.publish(spec)
        log.info("csi: %s volume %s (%s) at %s%s", "published" if started else "already had",
                 spec.volume_id, spec.url, spec.target, f" for pod {ns}/{pod}" if pod else "")
        return m.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, req: Any) -> Any:
        done = self.volumes.unpublish(req.volume_id, req.target_path)
        log.info("csi: %s volume %s at %s", "unpublished" if done else "nothing to unpublish of",
                 req.volume_id, req.target_path)
        return m.NodeUnpublishVolumeResponse()


def _method(service: str, method: str) -> str:
    return f"/{m.PACKAGE}.{service}/{method}"


def _handler(driver: NodeDriver, method: str) -> grpc.RpcMethodHandler:
    call: Callable[[Any], Any] = getattr(driver, method)

    def handle(req: Any, context: grpc.ServicerContext) -> Any:
        try:
            return call(req)
        except CsiError as exc:
            if exc.code == "INTERNAL":
                log.error("csi: %s failed: %s", method, exc)
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except Exception as exc:  # a bug or an OS error: INTERNAL, with the reason
            log.exception("csi: %s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=m.message(f"{method}Request").FromString,
        response_serializer=lambda resp: resp.SerializeToString())


def unix_path(endpoint: str) -> Path:
    """``unix:///csi/csi.sock`` (what kubelet sidecars pass) or a plain path -> the path."""
    if endpoint.startswith("unix://"):
        endpoint = endpoint[len("unix://"):]
    elif "://" in endpoint:
        raise InvalidArgument(f"--endpoint {endpoint!r}: only unix:// sockets are served")
    if not endpoint.startswith("/"):
        raise InvalidArgument(f"--endpoint {endpoint!r}: give an absolute path "
                              "(unix:///csi/csi.sock)")
    return Path(endpoint)


def serve(driver: NodeDriver, endpoint: str, workers: int = 8) -> grpc.Server:
    """Listen on the unix socket ``endpoint`` (a stale socket file is replaced: a kubelet
    plugin's socket outlives a crashed driver) and return the started server."""
    path = unix_path(endpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody answers on it: left by a driver that died
        else:
            raise InvalidArgument(f"another driver is serving {path}")
        finally:
            probe.close()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                    thread_name_prefix="csi"))
    for service, methods in m.SERVICES.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            f"{m.PACKAGE}.{service}", {x: _handler(driver, x) for x in methods}),))
    old = os.umask(0o077)  # the socket: for root (the kubelet, the registrar) only
    try:
        server.add_insecure_port(f"unix://{path}")
        server.start()
    finally:
        os.umask(old)
    return server


class CsiClient:
    """A CSI client of the calls above (what the kubelet sends), over a unix socket:
    ``CsiClient("unix:///csi/csi.sock").call("NodeGetInfo")``."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{unix_path(endpoint)}")
        self._stubs = {
            method: self.channel.unary_unary(
                _method(service, method),
                request_serializer=lambda req: req.SerializeToString(),
                response_deserializer=m.message(f"{method}Response").FromString)
            for service, methods in m.SERVICES.items() for method in methods}

    def call(self, method: str, request: Any = None, timeout: float = 120.0, **fields: Any
             ) -> Any:
        """``method`` with ``request`` (or a request made of ``fields``); raises
        grpc.RpcError with the status code on failure."""
        if request is None:
            request = m.message(f"{method}Request")(**fields)
        return self._stubs[method](request, timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CsiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
