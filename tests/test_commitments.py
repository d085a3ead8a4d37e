"""Blocks are checked against what the version commits to, not against the digest in their
own frame: a hostile hop between spoke and hub (here a proxy the test runs, which flips a
byte of every block and writes a digest that matches the new bytes) never gets a byte kept
or served. Real hub and spoke processes; the proxy is real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import urllib3
import xxhash
from aiohttp import web

from servers import hub, make_dataset, metric, spoke
from spokefs.errors import BadUpstream
from spokefs.integrity import version_id
from spokefs.spoke.commitments import Commitments, parse_commitment
from spokefs.wire.backend import DatasetInfo
from spokefs.wire.frames import HEADER_SIZE, decode_header, encode_header

BS = 256 * 1024


class TamperingProxy:
    """Passes every request to the hub; in ``flip`` mode, each block of a batch read comes
    back with one byte changed and a digest made for the changed bytes."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.flip = False
        self.flipped = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TamperingProxy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        async def session() -> aiohttp.ClientSession:
            return aiohttp.ClientSession(auto_decompress=False)

        self._session = self._loop.run_until_complete(session())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._session.close())
        self._loop.run_until_complete(runner.cleanup())

    async def _handle(self, request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length")}
        async with self._session.request(request.method, self.upstream + request.raw_path,
                                         headers=headers, data=await request.read()) as r:
            body = await r.read()
            out = {k: v for k, v in r.headers.items()
                   if k.lower() in ("content-type", "content-encoding", "etag")
                   or k.lower().startswith("x-spokefs-")}
            if self.flip and request.path.endswith("/blocks") and r.status == 200:
                body = self._tamper(body)
            return web.Response(status=r.status, body=body, headers=out)

    def _tamper(self, body: bytes) -> bytes:
        out, at = bytearray(), 0
        while at < len(body):
            h = decode_header(body[at:at + HEADER_SIZE])
            payload = bytearray(body[at + HEADER_SIZE:at + HEADER_SIZE + h.length])
            digest = h.digest
            if h.status == 200 and payload:
                payload[len(payload) // 2] ^= 0xFF
                digest = xxhash.xxh3_128_digest(payload)  # a digest that matches the lie
                self.flipped += 1
            out += encode_header(h.seq, h.status, h.length, h.object_size, digest) + payload
            at += HEADER_SIZE + h.length
        return bytes(out)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Path, TamperingProxy, str]]:
    ds = make_dataset(tmp_path / "ds", n_small=4, small_size=50_000,
                      big_sizes=(5 * BS + 1000,))
    with hub(ds, tmp_path / "hubstate", "--block-size", "256KiB") as h, \
            TamperingProxy(h.url) as proxy, \
            spoke(proxy.url, tmp_path / "cache", "64MiB", "--deadline", "5s",
                  "--no-prefetch") as s:
        yield ds, proxy, s.url


def test_blocks_altered_on_the_way_are_never_kept_or_served(stack) -> None:
    ds, proxy, base = stack
    http = urllib3.PoolManager(retries=False, timeout=30)
    names = ["class0/img0000.jpg", "shards/shard-000.tar"]  # one block; six blocks
    proxy.flip = True
    for name in names:
        try:
            r = http.request("GET", f"{base}/ds/{name}", preload_content=True)
        except urllib3.exceptions.ProtocolError:
            continue  # cut mid-body: the reader learns the read failed
        assert r.status >= 500 or r.data == (ds / name).read_bytes(), (name, r.status)
        assert r.status >= 500, (name, r.status)
    assert proxy.flipped > 0
    assert metric(base, "spokefs_integrity_failures_total") > 0
    # Nothing of the lies was kept: once the hop is honest, every byte is the dataset's.
    proxy.flip = False
    for name in names:
        r = http.request("GET", f"{base}/ds/{name}")
        assert r.status == 200 and r.data == (ds / name).read_bytes(), name


def test_a_digest_list_must_make_its_version_id() -> None:
    digests = [xxhash.xxh3_128_digest(bytes([i]) * BS) for i in range(3)]
    size = 2 * BS + 10
    v = version_id(size, BS, digests)
    c = parse_commitment(v, {"size": size, "digests": b"".join(digests).hex()}, BS)
    assert c.size == size
    for bad in ({"size": size + 1, "digests": b"".join(digests).hex()},
                {"size": size, "digests": b"".join(digests[::-1]).hex()},
                {"size": size, "digests": "zz"}, None, {"size": "1", "digests": ""}):
        with pytest.raises(BadUpstream):
            parse_commitment(v, bad, BS)
    info = DatasetInfo("ds", BS, None, content_ids=True)

    async def never(*_: object) -> dict[str, object]:
        raise AssertionError("no I/O in verdict")

    commits = Commitments(lambda name: info, never, never)  # type: ignore[arg-type]
    assert commits.verdict("ds", (v, 1), digests[1], size) is None  # list not known yet
    commits.keep(v, c)
    assert commits.verdict("ds", (v, 1), digests[1], size) is True
    assert commits.verdict("ds", (v, 1), digests[2], size) is False  # another block's
    assert commits.verdict("ds", (v, 1), digests[1], size - 1) is False  # another size
    one = xxhash.xxh3_128_digest(b"x" * 100)
    small = version_id(100, BS, [one])
    assert commits.verdict("ds", (small, 0), one, 100) is True
    assert commits.verdict("ds", (small, 0), xxhash.xxh3_128_digest(b"y"), 100) is False
    listing = DatasetInfo("b", BS, None, content_ids=False)  # a bucket's: nothing to check
    assert Commitments(lambda name: listing, never, never).verdict(  # type: ignore[arg-type]
        "b", (small, 0), one, 5) is True


def test_a_hostile_tier_member_never_gets_a_byte_kept_or_served(tmp_path: Path) -> None:
    """Member A believes its fellow member is at a proxy's address; the proxy passes A's
    batch reads to the real member B and, in flip mode, changes a byte of every block and
    writes a digest that matches the change. A checks what it gets from a member against
    what the version commits to, as it does the upstream's: every answer its readers get is
    the dataset's or an error, nothing of the lies is kept, and once the hop is honest every
    byte is right."""
    ds = make_dataset(tmp_path / "ds", n_small=12, small_size=50_000,
                      big_sizes=(5 * BS + 1000,))
    from servers import free_port  # a port each member names itself by

    pa, pb = free_port(), free_port()
    a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    with hub(ds, tmp_path / "hubstate", "--block-size", "256KiB") as h, \
            spoke(h.url, tmp_path / "cache-b", "64MiB", "--port", str(pb), "--workers", "1",
                  "--tier", f"{a},{b}", "--no-prefetch"), \
            TamperingProxy(b) as proxy, \
            spoke(h.url, tmp_path / "cache-a", "64MiB", "--port", str(pa), "--workers", "1",
                  "--tier", f"{a},{proxy.url}", "--tier-timeout", "3s", "--deadline", "10s",
                  "--no-prefetch", "--no-tier-copies") as sa:
        http = urllib3.PoolManager(retries=False, timeout=30)
        names = sorted(str(p.relative_to(ds)) for p in ds.rglob("*") if p.is_file())
        proxy.flip = True
        served = 0
        for name in names:
            try:
                r = http.request("GET", f"{sa.url}/ds/{name}")
            except urllib3.exceptions.ProtocolError:
                continue  # cut mid-body: the reader learns the read failed
            assert r.status >= 500 or r.data == (ds / name).read_bytes(), (name, r.status)
            served += r.status == 200
        assert proxy.flipped > 0  # the member was asked, and lied
        assert metric(sa.url, "spokefs_integrity_failures_total") > 0
        proxy.flip = False
        for name in names:
            r = http.request("GET", f"{sa.url}/ds/{name}")
            assert r.status == 200 and r.data == (ds / name).read_bytes(), name
