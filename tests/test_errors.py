"""The one mapping from what goes wrong talking to a peer to the exception tree
(``spokefs.wire.errors``): every error a peer can send comes back as itself, failures are
typed from real sockets' exceptions (not from their text), and the errors a client meets are
the builtin OSErrors a local file would raise."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import ssl
import struct
import threading
from collections.abc import Iterator

import aiohttp
import pytest
import urllib3

from spokefs import errors as E
from spokefs.errors import Failure, Transient
from spokefs.retry import UPSTREAM, retrying
from spokefs.wire.errors import error_for_status, error_for_transport, failure_kind
from spokefs.wire.http1 import DataClient

# One of each error a peer may send, as it would send it (``to_json``).
SENT = [E.NotFound("no such file 'a/b'"), E.VersionGone("version v1 is gone"),
        E.BadRequest("bad path"), E.TooLarge("a body past 1 MiB"),
        E.Unauthorized("no token"), E.Forbidden("a read token cannot purge"),
        E.LimitReached("too many jobs"), E.RateLimited("slow down", 2.5),
        E.RangeNotSatisfiable("past the end", 1234),
        E.UpstreamUnavailable("upstream h:1 unreachable for 3s: Connection refused", "h:1",
                              "Connection refused", Failure.REFUSED),
        E.IntegrityError("block 3 failed its check"), E.ConfigError("bad size"),
        E.BadUpstream("a manifest past its bound"), E.ManifestError("does not decode"),
        E.UntrustedCertificate("TLS: not trusted")]


@pytest.mark.parametrize("sent", SENT, ids=lambda e: type(e).__name__)
def test_every_error_a_peer_sends_comes_back_as_itself(sent: E.SpokeError) -> None:
    body = json.dumps(sent.to_json()).encode()
    got = error_for_status(sent.status, body, "fallback", final=True)
    assert type(got) is type(sent)
    assert str(got) == sent.to_json()["error"]["message"]  # type: ignore[index]
    if isinstance(sent, E.RangeNotSatisfiable):
        assert got.size == 1234  # type: ignore[attr-defined]
    if isinstance(sent, E.RateLimited):
        assert got.retry_after == 2.5  # type: ignore[attr-defined]
    if isinstance(sent, E.UpstreamUnavailable):
        assert got.kind is Failure.REFUSED and got.errno == errno.ECONNREFUSED  # type: ignore


def test_statuses_without_a_body_we_know() -> None:
    """Another server's answer (a proxy's HTML, nothing): by the status alone. A 502 is a
    502 (BadUpstream), not a 500; 5xx are worth retrying unless the answer is final."""
    cases = {400: E.BadRequest, 401: E.Unauthorized, 403: E.Forbidden, 404: E.NotFound,
             410: E.VersionGone, 413: E.TooLarge, 416: E.RangeNotSatisfiable,
             429: E.LimitReached, 502: E.BadUpstream, 503: E.UpstreamUnavailable,
             504: E.UpstreamUnavailable}
    for status, cls in cases.items():
        got = error_for_status(status, b"<html>nope</html>", f"GET /x: HTTP {status}",
                               final=True)
        assert type(got) is cls and str(got) == f"GET /x: HTTP {status}"
        assert got.status == status or status == 504  # type: ignore[attr-defined]
    assert error_for_status(502, None, "x", final=True).status == 502  # type: ignore[attr-defined]
    other = error_for_status(418, b"", "teapot", final=True)
    assert type(other) is E.SpokeError and str(other) == "HTTP 418: teapot"
    # A code that disagrees with its status is not believed.
    lying = json.dumps({"error": {"code": "not_found", "message": "m"}}).encode()
    assert type(error_for_status(400, lying, "x")) is E.BadRequest
    for status in (500, 502, 503, 504):
        t = error_for_status(status, b"", f"upstream answered {status} for /x")
        assert isinstance(t, Transient) and t.kind is Failure.UPSTREAM_ERROR
        assert str(t) == f"upstream answered {status} for /x"
    assert type(error_for_status(501, b"", "x")) is E.SpokeError  # not worth retrying


def test_the_old_name_maps_the_same() -> None:
    body = json.dumps(E.IntegrityError("bad").to_json())
    assert type(E.from_status(502, json.loads(body), "x")) is E.IntegrityError
    assert type(E.from_status(502, None, "the primary answered 502")) is E.BadUpstream


def test_client_errors_are_the_builtin_oserrors() -> None:
    """``except FileNotFoundError`` / ``PermissionError`` / ``OSError`` catch them; errno is
    set; the message (str) is unchanged; ``except NotFound`` still works."""
    for exc, builtin, code in ((E.NotFound("no such"), FileNotFoundError, errno.ENOENT),
                               (E.Unauthorized("no token"), PermissionError, errno.EACCES),
                               (E.Forbidden("read only"), PermissionError, errno.EACCES),
                               (E.VersionGone("gone"), OSError, errno.ESTALE)):
        with pytest.raises(builtin) as caught:
            raise exc
        assert caught.value.errno == code and caught.value.strerror == str(exc)
        assert str(exc) == exc.args[0] and isinstance(exc, E.SpokeError)
    down = E.UpstreamUnavailable("h unreachable for 3s: timed out", "h", "timed out")
    assert isinstance(down, ConnectionError) and down.errno == errno.ETIMEDOUT
    assert str(down) == "h unreachable for 3s: timed out"
    # What is not a client's file error stays what it was.
    assert not isinstance(E.BadRequest("x"), OSError)
    assert not isinstance(E.IntegrityError("x"), OSError)


def test_what_a_client_is_told_of_an_outage_is_its_kind() -> None:
    down = E.UpstreamUnavailable("upstream hub:8470 unreachable for 3s: [Errno 111] "
                                 "Connect call failed ('10.0.0.5', 8470)", "hub:8470",
                                 "[Errno 111] Connect call failed ('10.0.0.5', 8470)",
                                 Failure.REFUSED)
    doc = down.to_json()["error"]
    assert doc["cause"] == "connection refused" and "10.0.0.5" not in doc["message"]
    assert "hub:8470" not in doc["message"]
    # A cause known only as text still gets a kind (callers that have no more).
    assert E.UpstreamUnavailable("m", "u", "Connection reset by peer").kind is Failure.RESET
    assert E.cause_kind("no answer within 3s") == "no answer" and E.cause_kind("") == ""


def test_retrying_gives_up_with_the_kind_of_the_last_failure() -> None:
    clock = [0.0]

    async def sleep(s: float) -> None:
        clock[0] += s

    async def attempt() -> None:
        raise Transient("something odd happened", Failure.RESET)  # the text says nothing

    with pytest.raises(E.UpstreamUnavailable) as err:
        asyncio.run(retrying(attempt, UPSTREAM.within(1.0), lambda cause: E.UpstreamUnavailable(
            f"gone: {cause}", "u", cause), now=lambda: clock[0], sleep=sleep))
    assert err.value.kind is Failure.RESET and err.value.errno == errno.ECONNRESET


# -- failures of real sockets ---------------------------------------------------------------------
@pytest.fixture
def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


class _Server:
    """A TCP server on 127.0.0.1 whose every connection gets ``answer(conn)``."""

    def __init__(self, answer: object) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def resetting() -> Iterator[int]:
    """Reads the request, then resets the connection (RST, not FIN)."""
    def answer(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    s = _Server(answer)
    yield s.port
    s.close()


@pytest.fixture
def silent() -> Iterator[int]:
    done = threading.Event()

    def answer(conn: socket.socket) -> None:
        done.wait(10)
        conn.close()
    s = _Server(answer)
    yield s.port
    done.set()
    s.close()


def _urllib3_failure(url: str, read: float = 5.0) -> Exception:
    with pytest.raises(urllib3.exceptions.HTTPError) as err:
        urllib3.PoolManager(retries=False).request(
            "GET", url, timeout=urllib3.Timeout(connect=5, read=read))
    return err.value


async def _aiohttp_failure(url: str, read: float = 5.0) -> Exception:
    timeout = aiohttp.ClientTimeout(sock_read=read)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises((aiohttp.ClientError, TimeoutError)) as err:
            async with session.get(url) as resp:
                await resp.read()
    return err.value


def test_kinds_of_real_failures_urllib3(closed_port: int, resetting: int, silent: int) -> None:
    assert failure_kind(_urllib3_failure(f"http://127.0.0.1:{closed_port}/")) is Failure.REFUSED
    assert failure_kind(_urllib3_failure(f"http://127.0.0.1:{resetting}/")) in (
        Failure.RESET, Failure.CLOSED)
    late = _urllib3_failure(f"http://127.0.0.1:{silent}/", read=0.2)
    err = error_for_transport(late, "here")
    assert isinstance(err, Transient) and err.kind is Failure.TIMED_OUT


def test_kinds_of_real_failures_aiohttp(closed_port: int, resetting: int, silent: int) -> None:
    async def main() -> list[Failure]:
        return [failure_kind(await _aiohttp_failure(f"http://127.0.0.1:{p}/", read))
                for p, read in ((closed_port, 5.0), (resetting, 5.0), (silent, 0.2))]

    refused, reset, late = asyncio.run(main())
    assert refused is Failure.REFUSED and reset in (Failure.RESET, Failure.CLOSED)
    assert late is Failure.TIMED_OUT


def test_kinds_of_real_failures_data_client(closed_port: int) -> None:
    async def main() -> Exception:
        client = DataClient(f"http://127.0.0.1:{closed_port}", token=None)
        with pytest.raises(Transient) as err:
            await client.read_into("/x", 0, memoryview(bytearray(10)))
        return err.value

    err = asyncio.run(main())
    assert err.kind is Failure.REFUSED and "cannot connect" in str(err)  # type: ignore


def test_a_name_that_does_not_resolve() -> None:
    try:
        socket.getaddrinfo("no-such-host.invalid", 80)
    except socket.gaierror as exc:
        err = error_for_transport(exc, "no-such-host.invalid:80")
        assert isinstance(err, Transient) and err.kind is Failure.NAME_NOT_RESOLVED
    else:
        pytest.skip("this resolver answers for .invalid")


def test_tls_failures_are_final() -> None:
    """An untrusted certificate is named as such; https spoken to a plain port is a clear
    final error, not a retry until the deadline."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)

    def tls_answer(conn: socket.socket) -> None:
        try:
            with ctx.wrap_socket(conn, server_side=True) as c:
                c.recv(100)
        except (ssl.SSLError, OSError):
            pass

    def plain_answer(conn: socket.socket) -> None:
        conn.recv(1000)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        conn.close()

    tls_server, plain = _Server(tls_answer), _Server(plain_answer)
    try:
        where = f"127.0.0.1:{tls_server.port}"
        err = error_for_transport(_urllib3_failure(f"https://{where}/"), where)
        assert isinstance(err, E.UntrustedCertificate) and "--ca-bundle" in str(err)
        where = f"127.0.0.1:{plain.port}"
        err = error_for_transport(_urllib3_failure(f"https://{where}/"), where)
        assert isinstance(err, E.BadUpstream) and "does it serve https" in str(err)

        async def data_client() -> Exception:
            client = DataClient(f"https://127.0.0.1:{tls_server.port}", token=None)
            with pytest.raises(E.UntrustedCertificate) as caught:
                await client.read_into("/x", 0, memoryview(bytearray(10)))
            return caught.value

        assert "not trusted" in str(asyncio.run(data_client()))
    finally:
        tls_server.close()
        plain.close()


def test_a_patient_batch_read_waits_on_a_silent_server_that_answers_until_superseded() -> None:
    """A batch read with ``Patience`` to a server that sends nothing (a tier member waiting
    on its own upstream): while ``alive()`` says it answers, the read outlives its idle
    timeout; once ``superseded()`` says so, it ends with ``Superseded`` (not a failure: the
    caller asks again), and the server sees the connection dropped."""
    from spokefs.wire.http1 import Patience, Superseded

    async def main() -> tuple[float, int, float, bool]:
        dropped = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)  # the request; no answer, ever
            await reader.read()  # b"" once the client drops the connection
            dropped.set()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = DataClient(f"http://127.0.0.1:{port}", idle_timeout=0.3, token=None)
        asked = 0
        loop = asyncio.get_running_loop()
        began = loop.time()
        give_up_at = began + 1.0  # past three idle timeouts

        async def alive() -> bool:
            nonlocal asked
            asked += 1
            return True

        patience = Patience(alive, limit=30.0, ahead=0.1,
                            superseded=lambda: loop.time() >= give_up_at)
        try:
            with pytest.raises(Superseded):
                await client.read_blocks("/blocks", b"{}", lambda h: None, lambda h, p: None,
                                         patience=patience)
            waited = loop.time() - began
            await asyncio.wait_for(dropped.wait(), 5)
        finally:
            await client.close()
            server.close()
        # Without a superseded(): given up only at the limit, here a plain timeout after it.
        patience = Patience(alive, limit=0.5, ahead=0.1)
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = DataClient(f"http://127.0.0.1:{port}", idle_timeout=0.3, token=None)
        began = loop.time()
        try:
            with pytest.raises(Transient):
                await client.read_blocks("/blocks", b"{}", lambda h: None, lambda h, p: None,
                                         patience=patience)
        finally:
            await client.close()
            server.close()
        return waited, asked, loop.time() - began, dropped.is_set()

    waited, asked, limited, dropped = asyncio.run(main())
    # Upper bounds only against a hang (the machine may be loaded).
    assert 1.0 <= waited < 10 and asked >= 3 and dropped, (waited, asked)
    assert 0.5 <= limited < 10, limited
