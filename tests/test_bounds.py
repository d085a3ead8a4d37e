"""Memory per request, bounded in bytes where it is answered: a batch read's blocks (per
request, and a spoke's room for all of them together), a replica's forwarded answers
(streamed, not held), JSON by what it parses to, error bodies and frames by what the reader
expects rather than what the sender claims. Real hub and spoke processes (``--workers 2``) on
127.0.0.1, and a raw socket server playing a hostile upstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
import xxhash

from servers import ServerProcess, hub, spoke
from spokefs.errors import Transient
from spokefs.wire.bodies import MAX_PARSED, parsed_cost
from spokefs.wire.frames import HEADER_SIZE, FrameHeader, decode_header
from spokefs.wire.headers import H_PEER
from spokefs.wire.http1 import MAX_ERROR_BODY, DataClient
from spokefs.wire.server import MAX_BATCH_BYTES, ByteRoom

MiB = 1 << 20
READER = "reader-" + "r" * 32
TIER = "tier-" + "t" * 32
TRIES = 4  # fresh connections: each of the two workers answers some

pool = urllib3.PoolManager(retries=False, timeout=60)


# -- sans-I/O parts ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [
    "{}", "[]", "[1000,2000]", '{"a":1}', '"x%d"', "1.5", "100000", "[[1,2],{}]"])
def test_parsed_cost_is_an_upper_bound_of_what_json_makes(shape: str) -> None:
    items = [shape % i if "%d" in shape else shape for i in range(50_000)]
    for body in ("[" + ",".join(items) + "]",
                 "{" + ",".join(f'"k{i}":{v}' for i, v in enumerate(items)) + "}"):
        raw = body.encode()
        tracemalloc.start()
        value = json.loads(raw)
        made, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del value
        assert made <= parsed_cost(raw), (shape, made, parsed_cost(raw))
        assert parsed_cost(raw) <= 4 * made + len(raw)  # an estimate, not a wild guess


def test_byte_room_waits_in_turn_and_a_cancelled_waiter_passes_its_turn_on() -> None:
    async def main() -> list[str]:
        room = ByteRoom(100)
        order: list[str] = []
        release = asyncio.Event()

        async def hold(name: str, n: int) -> None:
            async with room.take(n):
                order.append(name)
                await release.wait()

        first = asyncio.create_task(hold("a", 60))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(hold("b", 60))    # no room: waits
        small = asyncio.create_task(hold("c", 10))      # room, but after b: waits too
        await asyncio.sleep(0)
        assert order == ["a"] and room.free == 40
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)
        assert order == ["a", "c"] and room.free == 30
        huge = asyncio.create_task(hold("d", 10_000))   # more than all: takes all, waits
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, small, huge)
        assert room.free == 100
        return order

    assert asyncio.run(main()) == ["a", "c", "d"]


# -- a hostile upstream's claims ----------------------------------------------------------------
async def _claiming_server(head: bytes) -> tuple[asyncio.AbstractServer, str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        await writer.drain()
        await asyncio.sleep(5)  # the rest never comes
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_an_error_answer_claiming_a_huge_body_is_refused_at_its_head() -> None:
    async def main() -> str:
        server, url = await _claiming_server(
            b"HTTP/1.1 500 Oops\r\nContent-Type: application/json\r\n"
            b"Content-Length: 8000000000\r\n\r\n{")
        client = DataClient(url)
        try:
            tracemalloc.start()
            with pytest.raises(Transient) as err:
                await asyncio.wait_for(client.read_into("/v1/datasets/ds/objects/v", 0,
                                                        memoryview(bytearray(10))), 5)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < 8 * MiB
            return str(err.value)
        finally:
            await client.close()
            server.close()

    assert f"more than the {MAX_ERROR_BODY}" in asyncio.run(main())


def test_a_range_answer_for_another_range_is_never_taken() -> None:
    """A 206 whose Content-Range starts elsewhere than the read asked holds other bytes: the
    data client refuses it (Transient: asked again), and the buffer keeps nothing of it."""
    async def main() -> tuple[str, bytes]:
        server, url = await _claiming_server(
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-109/1000\r\n"
            b"Content-Length: 10\r\n\r\n" + b"x" * 10)
        client = DataClient(url)
        buf = bytearray(10)
        try:
            with pytest.raises(Transient) as err:
                await asyncio.wait_for(client.read_into("/ds/f", 0, memoryview(buf)), 5)
            return str(err.value), bytes(buf)
        finally:
            await client.close()
            server.close()

    message, buf = asyncio.run(main())
    assert "for a read at 0" in message and buf == bytes(10)


# -- real servers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Path, ServerProcess, ServerProcess]]:
    root = tmp_path_factory.mktemp("bounds")
    ds = root / "ds"
    ds.mkdir()
    big = ds / "big.bin"
    big.write_bytes(bytes(range(256)) * (((MAX_BATCH_BYTES + 6 * MiB)) // 256))
    (root / "spoke.tokens").write_text(f"reader read:ds {READER}\ntier tier {TIER}\n")
    with hub(ds, root / "hubstate", "--block-size", "1MiB") as h, \
            spoke(h.url, root / "cache", "512MiB", "--workers", "2",
                  "--auth", str(root / "spoke.tokens")) as s:
        yield big, h, s


def _version(base: str) -> tuple[str, int]:
    m = pool.request("GET", f"{base}/v1/datasets/ds/snapshots/latest/entries/big.bin",
                     headers={"Authorization": f"Bearer {READER}"})
    assert m.status == 200, m.data
    doc = json.loads(m.data)
    return doc["version"], doc["size"]


def _batch(base: str, blocks: list[list[object]], token: str = READER,
           extra: dict[str, str] | None = None) -> urllib3.BaseHTTPResponse:
    return pool.request("POST", f"{base}/v1/datasets/ds/blocks",
                        body=json.dumps({"blocks": blocks}).encode(),
                        headers={"Authorization": f"Bearer {token}", "Connection": "close",
                                 "Content-Type": "application/json", **(extra or {})})


def _frames(body: bytes) -> dict[int, tuple[FrameHeader, bytes]]:
    out, at = {}, 0
    while at < len(body):
        h = decode_header(body[at:at + HEADER_SIZE])
        out[h.seq] = (h, body[at + HEADER_SIZE:at + HEADER_SIZE + h.length])
        at += HEADER_SIZE + h.length
    return out


def test_a_batch_read_past_the_byte_budget_is_refused_on_every_worker(servers) -> None:
    _, _, s = servers
    version, size = _version(s.url)
    n = MAX_BATCH_BYTES // MiB + 1  # one block past the budget
    assert size >= n * MiB
    for _ in range(TRIES):
        resp = _batch(s.url, [[version, i] for i in range(n)])
        assert resp.status == 413, resp.data[:200]
        assert json.loads(resp.data)["error"]["code"] == "too_large"
        assert f"{MAX_BATCH_BYTES >> 20} MiB" in json.loads(resp.data)["error"]["message"]


def test_a_batch_within_the_budget_is_served_whole_by_every_worker(servers) -> None:
    big, _, s = servers
    version, _ = _version(s.url)
    data = big.read_bytes()
    want = list(range(4, 4 + MAX_BATCH_BYTES // MiB))  # exactly the budget
    for _ in range(TRIES):
        resp = _batch(s.url, [[version, i] for i in want])
        assert resp.status == 200
        frames = _frames(resp.data)
        assert sorted(frames) == list(range(len(want)))
        for seq, i in enumerate(want):
            h, payload = frames[seq]
            assert h.status == 200 and payload == data[i * MiB:(i + 1) * MiB]
            assert xxhash.xxh3_128_digest(payload) == h.digest


def test_a_peer_batch_forwarded_by_a_replica_arrives_whole(servers) -> None:
    """A replica passes a tier member's batch read to the primary and streams the answer on
    (``ReplicaBackend.forward``): 64 MiB through either worker, every byte right."""
    big, _, s = servers
    version, _ = _version(s.url)
    data = big.read_bytes()
    want = list(range(MAX_BATCH_BYTES // MiB))
    for _ in range(TRIES):
        resp = _batch(s.url, [[version, i] for i in want], TIER, {H_PEER: "read"})
        assert resp.status == 200, resp.data[:200]
        frames = _frames(resp.data)
        assert all(frames[seq][1] == data[i * MiB:(i + 1) * MiB] for seq, i in enumerate(want))


def test_json_that_would_parse_past_its_budget_is_refused_unparsed(servers) -> None:
    _, _, s = servers
    n = MAX_PARSED // 72 + 1
    body = b"[" + b"{}," * n + b"{}]"
    assert len(body) < 64 * MiB  # within the body cap: the parse budget refuses it
    for _ in range(TRIES):
        resp = pool.request("POST", f"{s.url}/v1/datasets/ds/jobs/j/order", body=body,
                            headers={"Authorization": f"Bearer {READER}",
                                     "Connection": "close",
                                     "Content-Type": "application/json"})
        assert resp.status == 413, resp.data[:200]
        assert "parse" in json.loads(resp.data)["error"]["message"]
    assert pool.request("GET", f"{s.url}/v1/openapi.json").status == 200  # still up
