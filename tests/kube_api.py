"""A stand-in for the Kubernetes API server, for the tier's member watch
(``spokefs.tier.sources.KubernetesMembers``).

A real API server (with etcd) is something these tests cannot start, so this small HTTPS
server on 127.0.0.1 speaks the subset of the API the watch uses, as the API server does:

- ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=...``: an
  ``EndpointSliceList`` with the collection's ``resourceVersion``;
- the same with ``watch=true&resourceVersion=RV``: a chunked stream of JSON lines
  ``{"type": "ADDED" | "MODIFIED" | "DELETED", "object": {...}}``, every change after RV
  first and then each change as it happens, ended after ``timeoutSeconds``; a version older
  than the server keeps history for gets one ``ERROR`` event with a 410 ``Status`` ("too old
  resource version"), as a watch cache that has moved on answers;
- a bearer token checked against the service account's token file at each request (a
  rotated token must be read again), 401 otherwise.

The test drives it: ``put`` and ``delete`` slices (each a new resourceVersion and an event),
``forget`` a deletion (no event: what a watch that was away would miss), ``expire`` every
watch (410), ``drop`` every open watch connection without ending its stream, ``fail`` the
next requests with a 500.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

SERVICE_LABEL = "kubernetes.io/service-name"


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, bool]],
                   port: int = 8471, namespace: str = "ml") -> dict[str, Any]:
    """An EndpointSlice of ``service`` with (hostname, ready) endpoints; addresses made up."""
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {SERVICE_LABEL: service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [f"10.1.0.{i + 10}"], "hostname": host,
                       "conditions": {"ready": ready, "serving": ready,
                                      "terminating": False}}
                      for i, (host, ready) in enumerate(endpoints)],
        "ports": [{"name": "http", "protocol": "TCP", "port": port}],
    }


class FakeKubeAPI:
    def __init__(self, sa_dir: Path, ssl_context: ssl.SSLContext, namespace: str = "ml"
                 ) -> None:
        self.sa_dir = sa_dir
        self.namespace = namespace
        self.cond = threading.Condition()
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 1000
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object)
        self.oldest = 0         # watches from a version below this get 410
        self.requests: list[dict[str, Any]] = []  # what each request asked, in order
        self.failing = 0        # answer this many next requests with a 500
        self.drops = 0          # bumped by drop(): open watches cut
        self.expiries = 0       # bumped by expire(): open watches get 410
        self.closing = False
        self.watching = 0       # watches streaming now
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api._serve(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = ssl_context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    # -- what the test does ------------------------------------------------------------------
    def _change(self, kind: str, obj: dict[str, Any], record: bool = True) -> None:
        with self.cond:
            self.version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.slices.pop(obj["metadata"]["name"], None)
            else:
                self.slices[obj["metadata"]["name"]] = obj
            if record:
                self.history.append((self.version, kind, obj))
            self.cond.notify_all()

    def put(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self._change("MODIFIED" if name in self.slices else "ADDED", obj)

    def delete(self, name: str) -> None:
        self._change("DELETED", self.slices[name])

    def forget(self, name: str) -> None:
        """Delete a slice with no event: a watch away at the time never hears of it."""
        self._change("DELETED", self.slices[name], record=False)

    def expire(self) -> None:
        """The watch cache moves on: every version seen so far is too old (410)."""
        with self.cond:
            self.oldest = self.version + 1
            self.history.clear()
            self.expiries += 1
            self.cond.notify_all()

    def drop(self) -> None:
        """Cut every open watch connection mid-stream (no end of the chunked body)."""
        with self.cond:
            self.drops += 1
            self.cond.notify_all()

    def fail(self, n: int) -> None:
        with self.cond:
            self.failing = n

    def wait_watching(self, timeout: float = 10.0) -> None:
        """Until a watch is streaming (so what the test does next reaches it as an event)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.watching > 0, timeout):
                raise AssertionError("no watch came")

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the API ---------------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        u = urlsplit(h.path)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        watch = q.get("watch") == "true"
        token = (self.sa_dir / "token").read_text().strip()
        with self.cond:
            self.requests.append({"watch": watch, "resourceVersion": q.get("resourceVersion"),
                                  "time": time.monotonic(),
                                  "token_ok": h.headers.get("Authorization")
                                  == f"Bearer {token}"})
            failing = self.failing > 0
            self.failing -= failing
        if failing:
            return self._status(h, 500, "InternalError", "etcdserver: leader changed")
        if not self.requests[-1]["token_ok"]:
            return self._status(h, 401, "Unauthorized", "Unauthorized")
        want = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        if u.path != want:
            return self._status(h, 404, "NotFound", f"no route {u.path}")
        selector = q.get("labelSelector", "")
        key, _, value = selector.partition("=")
        if key != SERVICE_LABEL or not value:
            return self._status(h, 400, "BadRequest", f"unexpected selector {selector!r}")

        def mine(obj: dict[str, Any]) -> bool:
            return obj["metadata"]["labels"].get(SERVICE_LABEL) == value

        if not watch:
            with self.cond:
                items = [s for s in self.slices.values() if mine(s)]
                body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": str(self.version)}, "items": items}
            return self._json(h, 200, body)
        self._watch(h, int(q.get("resourceVersion") or 0), float(q.get("timeoutSeconds", 300)),
                    mine)

    def _watch(self, h: BaseHTTPRequestHandler, since: int, timeout: float, mine: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        end = time.monotonic() + timeout
        with self.cond:
            drops, expiries = self.drops, self.expiries
            self.watching += 1
            self.cond.notify_all()
        try:
            while True:
                with self.cond:
                    if since < self.oldest - 1 or self.expiries != expiries:
                        event = {"type": "ERROR", "object": {
                            "kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "Expired", "code": 410,
                            "message": f"too old resource version: {since} ({self.oldest})"}}
                        pending = [event]
                        finish = True
                    else:
                        pending = [{"type": kind, "object": obj}
                                   for v, kind, obj in self.history if v > since and mine(obj)]
                        since = self.version
                        finish = False
                    if not pending and not finish:
                        self.cond.wait_for(
                            lambda at=since: self.version > at or self.drops != drops
                            or self.expiries != expiries or self.closing
                            or time.monotonic() >= end, max(0.0, end - time.monotonic()))
                        if self.drops != drops:
                            h.connection.shutdown(socket.SHUT_RDWR)  # cut, no last chunk
                            h.close_connection = True
                            return
                        if self.closing or time.monotonic() >= end:
                            finish = True
                for event in pending:
                    send(event)
                if finish:
                    h.wfile.write(b"0\r\n\r\n")  # the end of the stream: a clean close
                    h.wfile.flush()
                    h.close_connection = True
                    return
        except OSError:
            h.close_connection = True  # the client went away
        finally:
            with self.cond:
                self.watching -= 1

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _status(self, h: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        self._json(h, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "reason": reason, "message": message, "code": code})
