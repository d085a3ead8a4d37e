"""spokefs.open and the spokefs:// fsspec filesystem against a real spoke (and a hub over
https), their errors as the builtin OSErrors, and the data client never giving a response to
another request."""

from __future__ import annotations

import asyncio
import errno
import io
import random
import ssl
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import urllib3

import spokefs
from servers import ServerProcess, hub, make_dataset
from spokefs.client.urls import parse_url
from spokefs.errors import BadRequest, ConfigError, Transient
from spokefs.mount.source import Target
from spokefs.wire.http1 import DataClient


def test_url_rules() -> None:
    """One grammar for every spokefs URL (open, fsspec, status, warm, purge, the mount):
    ``[http[s]|spokefs]://host:port/<dataset>[@<snapshot>][/<path>]``."""
    u = parse_url("spoke:8471/imagenet/train/x.jpg")
    assert (u.base, u.dataset, u.snapshot, u.path) == (
        "http://spoke:8471", "imagenet", "latest", "train/x.jpg")
    u = parse_url("spokefs://h:1/ds@3fa9c1d20b7e/a%20b/")
    assert (u.base, u.dataset, u.snapshot, u.path) == ("http://h:1", "ds", "3fa9c1d20b7e", "a b")
    assert parse_url("https://h/ds").base == "https://h"
    for bad in ("ftp://h/ds", "http://h", "http:///ds"):
        with pytest.raises(ConfigError):
            parse_url(bad)
    for bad in ("http://h/ds/../x", "http://h/bad name/x", "http://h/ds@../x"):
        with pytest.raises(BadRequest):
            parse_url(bad)
    # The mount reads a dataset URL by the same rules.
    for url in ("http://h:1/ds", "h:1/ds@3fa9c1d20b7e", "https://h/ds/"):
        t, u = Target.parse(url), parse_url(url)
        assert (t.base, t.dataset, t.snapshot) == (u.base, u.dataset, u.snapshot)


def test_open_seek_read_readinto(spoke_server, dataset: Path) -> None:
    src = (dataset / "shards/shard-000.tar").read_bytes()
    rng = random.Random(3)
    with spokefs.open(f"{spoke_server.url}/ds/shards/shard-000.tar") as f:
        assert f.seekable() and f.readable()
        for _ in range(20):
            off = rng.randrange(len(src))
            n = rng.randrange(1, 3 << 20)
            f.seek(off)
            assert f.read(n) == src[off:off + n]
        f.seek(-10, io.SEEK_END)
        assert f.read() == src[-10:]
        assert f.read(5) == b""
        f.seek(0)
        buf = bytearray(1000)
        assert f.readinto(buf) == 1000 and bytes(buf) == src[:1000]
        assert f.tell() == 1000


def test_open_is_pinned_to_its_snapshot(spoke_server, hub_server, dataset: Path) -> None:
    path = dataset / "class2/img0006.jpg"
    old = path.read_bytes()
    f = spokefs.open(f"{spoke_server.url}/ds/class2/img0006.jpg", buffering=0)
    assert f.read(10) == old[:10]
    path.write_bytes(b"new" * 100)
    urllib3.request("POST", f"{hub_server.url}/v1/datasets/ds/snapshots")
    # The open file keeps its version: the rest comes from cache, never the new content.
    assert f.read() == old[10:]


def test_open_errors(spoke_server) -> None:
    with pytest.raises(spokefs.NotFound):
        spokefs.open(f"{spoke_server.url}/ds/no/such/file")
    with pytest.raises(IsADirectoryError):
        spokefs.open(f"{spoke_server.url}/ds/class1")
    with pytest.raises(spokefs.Forbidden, match="read-only"):  # at open, not at close
        spokefs.open(f"{spoke_server.url}/ds/class1/img0001.jpg", "wb")
    with pytest.raises(ValueError, match="not supported"):
        spokefs.open(f"{spoke_server.url}/ds/class1/img0001.jpg", "ab")
    with pytest.raises(spokefs.ConfigError):
        spokefs.open("ftp://x/y")


def test_fsspec_filesystem(spoke_server, dataset: Path) -> None:
    host = spoke_server.url.split("://", 1)[1]
    fs = fsspec.filesystem("spokefs")
    names = fs.ls(f"spokefs://{host}/ds", detail=False)
    assert f"{host}/ds/class0" in names and f"{host}/ds/empty.txt" in names
    info = fs.info(f"spokefs://{host}/ds/class0/img0000.jpg")
    src = (dataset / "class0/img0000.jpg").read_bytes()
    assert info["size"] == len(src) and info["type"] == "file"
    assert fs.cat_file(f"spokefs://{host}/ds/class0/img0000.jpg", 5, 50) == src[5:50]
    with fsspec.open(f"spokefs://{host}/ds/shards/shard-001.tar", "rb") as f:
        assert f.read() == (dataset / "shards/shard-001.tar").read_bytes()
    assert fs.info(f"spokefs://{host}/ds/empty_dir")["type"] == "directory"
    with pytest.raises(FileNotFoundError):
        fs.info(f"spokefs://{host}/ds/nope")
    found = fs.find(f"spokefs://{host}/ds")
    assert len(found) == 23


def test_client_errors_are_the_builtin_oserrors(spoke_server) -> None:
    """A user catches them the usual way (``except FileNotFoundError`` around
    ``spokefs.open`` and fsspec), and ``except spokefs.NotFound`` still works."""
    url = f"{spoke_server.url}/ds/no/such/file"
    with pytest.raises(FileNotFoundError) as err:
        spokefs.open(url)
    assert err.value.errno == errno.ENOENT and isinstance(err.value, spokefs.NotFound)
    assert "no/such/file" in str(err.value) and not str(err.value).startswith("[Errno")
    host = spoke_server.url.split("://", 1)[1]
    with pytest.raises(FileNotFoundError):
        fsspec.open(f"spokefs://{host}/nosuchdataset/x").open()
    with pytest.raises(OSError):
        spokefs.open(f"{spoke_server.url}/ds/no/such/file")


# -- over https, with tokens ---------------------------------------------------------------------
READER = "reader-" + "r" * 32


@pytest.fixture(scope="module")
def tls_hub(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Path, ServerProcess, Path]]:
    """A hub over https (a throwaway authority's certificate) with tokens on."""
    import trustme

    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(root / "server.pem"))
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    (root / "tokens").write_text(f"reader read {READER}\n")
    ds = make_dataset(root / "ds", n_small=4, big_sizes=(5_000_000,))
    with hub(ds, root / "state", "--auth", str(root / "tokens"), "--tls-cert",
             str(root / "server.pem"), "--tls-key", str(root / "server.pem")) as h:
        yield ds, h, root


@pytest.fixture
def trusting(tls_hub, monkeypatch) -> Iterator[None]:
    from spokefs.wire import tls

    monkeypatch.setenv("SPOKEFS_CA_BUNDLE", str(tls_hub[2] / "ca.pem"))
    monkeypatch.setenv("SPOKEFS_TOKEN", READER)
    tls._client_context.cache_clear()
    yield
    tls._client_context.cache_clear()


def test_fsspec_over_https(tls_hub, trusting) -> None:
    ds, h, _ = tls_hub
    assert h.url.startswith("https://")
    host = h.url.split("://", 1)[1]
    name = "shards/shard-000.tar"
    with fsspec.open(f"spokefs://{host}/ds/{name}", "rb", use_https=True) as f:
        f.seek(4 * 1024 * 1024)
        assert f.read(1000) == (ds / name).read_bytes()[4 * 1024 * 1024:][:1000]
    fs = fsspec.filesystem("spokefs", use_https=True)
    assert fs.info(f"spokefs://{host}/ds/{name}")["size"] == 5_000_000
    assert f"{host}/ds/class0" in fs.ls(f"spokefs://{host}/ds", detail=False)
    with pytest.raises(FileNotFoundError):
        fs.info(f"spokefs://{host}/ds/nope")
    # Plain http to the TLS port: a clear error, at once (not retried until the deadline).
    with pytest.raises(OSError):
        fsspec.filesystem("spokefs", deadline=2).info(f"spokefs://{host}/ds/{name}")


def test_a_refused_token_is_a_permission_error(tls_hub, trusting, monkeypatch) -> None:
    _, h, _ = tls_hub
    monkeypatch.setenv("SPOKEFS_TOKEN", "nobody-" + "n" * 32)
    with pytest.raises(PermissionError) as err:
        spokefs.open(f"{h.url}/ds/class0/img0000.jpg")
    assert err.value.errno == errno.EACCES and isinstance(err.value, spokefs.Unauthorized)
    monkeypatch.delenv("SPOKEFS_TOKEN")
    with pytest.raises(PermissionError):
        fsspec.filesystem("spokefs", use_https=True, skip_instance_cache=True).info(
            f"spokefs://{h.url.split('://', 1)[1]}/ds/class0/img0000.jpg")


# -- the data client: a response never reaches another request ------------------------------------
class _Scripted:
    """An HTTP/1.1 server (optionally TLS) on 127.0.0.1 that answers each request on a
    connection with the next of ``script(request_number, range_start)``'s byte strings,
    written when ``release`` allows (tests hold the rest of a body back with it)."""

    def __init__(self, script, tls: ssl.SSLContext | None = None) -> None:
        self.script, self.tls = script, tls
        self.requests = 0
        self.closed = asyncio.Event()
        self.release = asyncio.Event()
        self.sent_part = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0, ssl=self.tls)
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                start = int(head.split(b"bytes=", 1)[1].split(b"-", 1)[0])
                self.requests += 1
                for piece in self.script(self.requests, start):
                    if piece is None:  # hold the rest back until released
                        self.sent_part.set()
                        await self.release.wait()
                        continue
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            self.closed.set()
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def _answer_for(start: int, body: bytes, etag: str = "v1") -> bytes:
    return (f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
            f"Content-Range: bytes {start}-{start + len(body) - 1}/{1 << 30}\r\n"
            f'ETag: "{etag}"\r\n\r\n').encode() + body


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, f"still waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("use_tls", [False, True], ids=["http", "https"])
def test_a_read_given_up_mid_body_leaves_its_buffer_alone(use_tls: bool, tmp_path: Path,
                                                          monkeypatch) -> None:
    """The mount gives a read up mid-body (its deadline, an interrupted reader) and reuses
    the buffer: the rest of that body, sent after, must land nowhere, over TLS too (its
    transport decrypts what it already holds); the next read gets its own bytes."""
    size = 4 << 20
    blob = bytes(range(256)) * (size // 256 * 2)
    tls = None
    if use_tls:
        import trustme

        from spokefs.wire import tls as wire_tls

        ca = trustme.CA()
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(tls)
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SPOKEFS_CA_BUNDLE", str(tmp_path / "ca.pem"))
        wire_tls._client_context.cache_clear()

    def script(n: int, start: int) -> list[bytes | None]:
        answer = _answer_for(start, blob[start:start + size])
        if n == 1:  # half, then (once released) the rest and more: a late delivery
            return [answer[:len(answer) // 2], None, answer[len(answer) // 2:], b"x" * 65536]
        return [answer]

    async def main() -> None:
        server = _Scripted(script, tls)
        client = DataClient(await server.start(), token=None)
        buf = bytearray(size)
        try:
            task = asyncio.create_task(client.read_into("/o", 0, memoryview(buf)))
            await server.sent_part.wait()
            quarter = slice(size // 4, size // 4 + 256)
            await _until(lambda: buf[quarter] == blob[quarter], "half the body in the buffer")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            given_up = bytes(buf)
            server.release.set()  # the rest of the body goes out now, into a dead connection
            await asyncio.wait_for(server.closed.wait(), 10)
            await asyncio.sleep(0)  # a loop turn for any late callback
            assert bytes(buf) == given_up, "bytes landed in a buffer given up"
            other = bytearray(size)
            n, _ = await client.read_into("/o", size, memoryview(other))
            assert n == size and bytes(other) == blob[size:2 * size]
            assert bytes(buf) == given_up
        finally:
            await client.close()
            await server.stop()
            if use_tls:
                from spokefs.wire import tls as wire_tls

                wire_tls._client_context.cache_clear()

    asyncio.run(main())


def test_a_response_nobody_asked_for_never_answers_another_read() -> None:
    """A server out of step (an answer sent twice) puts a response on the connection that
    the next request could take for its own. Sent with the first, it is bytes nobody asked
    for: refused. Sent once the next request is out, only its content can tell: a read that
    names its version (``etag``) refuses another version's bytes before they reach it."""
    first = b"a" * 1000

    def twice(n: int, start: int) -> list[bytes | None]:
        return [_answer_for(start, first) * 2]

    def stale_after_next(n: int, start: int) -> list[bytes | None]:
        # The answer to request 1, and for request 2 an answer of another version first.
        if n == 1:
            return [_answer_for(start, first)]
        return [_answer_for(start, b"b" * 1000, etag="other"), _answer_for(start, first)]

    async def main() -> None:
        server = _Scripted(twice)
        client = DataClient(await server.start(), token=None)
        buf = bytearray(1000)
        try:
            with pytest.raises(Transient, match="nobody asked for"):
                await client.read_into("/o", 0, memoryview(buf))
            assert not client._idle  # that connection is gone
        finally:
            await client.close()
            await server.stop()
        server = _Scripted(stale_after_next)
        client = DataClient(await server.start(), token=None)
        try:
            n, _ = await client.read_into("/o", 0, memoryview(buf), etag="v1")
            assert n == 1000 and bytes(buf) == first
            buf[:] = bytes(1000)
            with pytest.raises(Transient, match="ETag"):
                await client.read_into("/o", 0, memoryview(buf), etag="v1")
            assert bytes(buf) == bytes(1000)  # nothing of the other version's bytes
        finally:
            await client.close()
            await server.stop()

    asyncio.run(main())
