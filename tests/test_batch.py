"""Batch reads: the frame format (sans-I/O), the data client against a real hub, and a
response cut in the middle retried for the missing blocks only."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from servers import CuttingProxy
from spokefs.cache.store import BlockStore
from spokefs.manifest import Manifest
from spokefs.policy import make_policy
from spokefs.spoke.fetcher import Fetcher
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.tasks import Tasks
from spokefs.wire.frames import (
    HEADER_SIZE,
    MAX_UNWANTED,
    FrameError,
    FrameHeader,
    FrameReader,
    encode_header,
)
from spokefs.wire.http1 import DataClient


def frames_of(payloads: list[bytes]) -> bytes:
    return b"".join(encode_header(i, 200, len(p), 10_000 + i, xxhash.xxh3_128_digest(p)) + p
                    for i, p in enumerate(payloads))


def collect() -> tuple[FrameReader, list[tuple[FrameHeader, bytes]]]:
    got: list[tuple[FrameHeader, bytes]] = []
    reader = FrameReader(own_buffer, lambda h, payload: got.append((h, bytes(payload))))
    return reader, got


def own_buffer(h: FrameHeader) -> memoryview:
    return memoryview(bytearray(h.length))


@pytest.mark.parametrize("split", [1, 7, HEADER_SIZE, HEADER_SIZE + 1, 4096, 1 << 20])
def test_frames_survive_any_split(split: int) -> None:
    rng = random.Random(split)
    payloads = [rng.randbytes(n) for n in (0, 1, 39, 40, 41, 5000, 70_000)]
    body = frames_of(payloads)
    reader, got = collect()
    for at in range(0, len(body), split):
        reader.feed(memoryview(body)[at:at + split])
    assert reader.between_frames and [p for _, p in got] == payloads
    assert [h.seq for h, _ in got] == list(range(len(payloads)))
    assert all(h.object_size == 10_000 + h.seq for h, _ in got)


def test_frames_received_straight_into_their_destination() -> None:
    payloads = [b"a" * 100_000, b"b" * 3]
    dest = [bytearray(100_000), bytearray(3)]
    done: list[int] = []
    reader = FrameReader(lambda h: memoryview(dest[h.seq]), lambda h, p: done.append(h.seq))
    body = memoryview(frames_of(payloads))
    reader.feed(body[:HEADER_SIZE + 10])          # a header and a little of the payload
    target = reader.buffer()                      # the rest goes in place, no copy
    assert len(target) == 100_000 - 10
    target[:] = body[HEADER_SIZE + 10:HEADER_SIZE + 100_000]
    reader.advance(len(target))
    reader.feed(body[HEADER_SIZE + 100_000:])
    assert done == [0, 1] and bytes(dest[0]) == payloads[0] and bytes(dest[1]) == b"bbb"


def test_a_frame_nobody_asked_for_is_refused_before_a_buffer_of_its_size() -> None:
    """The sender names a frame's length: an error body or a block nobody wants is kept in
    a buffer of the reader's only up to MAX_UNWANTED bytes; past it the stream is refused at
    the header, before anything of that size is made."""
    got: list[int] = []
    reader = FrameReader(lambda h: None, lambda h, p: got.append(len(p)))
    reader.feed(memoryview(encode_header(0, 404, MAX_UNWANTED) + bytes(MAX_UNWANTED)))
    assert got == [MAX_UNWANTED] and reader.between_frames
    with pytest.raises(FrameError, match=f"at most {MAX_UNWANTED}"):
        reader.feed(memoryview(encode_header(1, 200, 1 << 31)))


def test_a_body_that_is_not_frames_is_refused() -> None:
    reader, _ = collect()
    with pytest.raises(FrameError, match="magic"):
        reader.feed(memoryview(b"HTTP/1.1 200 OK\r\n" + bytes(40)))


# -- against a real hub ----------------------------------------------------------------------
async def _manifest(client: DataClient, url: str) -> Manifest:
    from spokefs.wire.client import UpstreamClient

    c = UpstreamClient(url)
    try:
        return await c.manifest("ds", "latest")
    finally:
        await c.close()


def test_data_client_reads_a_batch_from_the_hub(ro_hub, ro_dataset: Path) -> None:
    async def main() -> None:
        client = DataClient(ro_hub.url)
        m = await _manifest(client, ro_hub.url)
        blocks = [(e.version, 0) for e in m.entries() if e.size][:12]
        blocks.append(("0" * 32, 0))  # a version the hub never had: an error frame
        got: dict[int, tuple[FrameHeader, bytes]] = {}
        body = json.dumps({"blocks": [list(b) for b in blocks]}).encode()
        n = await client.read_blocks("/v1/datasets/ds/blocks", body, own_buffer,
                                     lambda h, p: got.__setitem__(h.seq, (h, bytes(p))))
        await client.close()
        assert n == len(blocks)
        by_version = {e.version: e for e in m.entries()}
        for seq, (version, _) in enumerate(blocks[:-1]):
            h, data = got[seq]
            e = by_version[version]
            assert h.status == 200 and h.object_size == e.size
            assert data == (ro_dataset / e.path).read_bytes()[:m.block_size]
            assert xxhash.xxh3_128_digest(data) == h.digest
        h, err = got[len(blocks) - 1]
        assert h.status == 410 and json.loads(err)["error"]["code"] == "version_gone"

    asyncio.run(main())


def test_a_batch_cut_in_the_middle_is_retried_for_the_missing_blocks_only(
        ro_hub, tmp_path: Path) -> None:
    async def main() -> None:
        host, port = ro_hub.hostport.split(":")
        m = await _manifest(DataClient(ro_hub.url), ro_hub.url)
        entries = [e for e in m.entries() if 0 < e.size <= m.block_size][:10]
        # Cut inside the fourth block's payload: three whole frames arrive.
        cut = 400 + sum(HEADER_SIZE + e.size for e in entries[:3]) + HEADER_SIZE + 100
        proxy = CuttingProxy((host, int(port)), cut)
        pport = await proxy.start()
        store = await asyncio.to_thread(
            BlockStore(tmp_path / "cache", 1 << 30, make_policy("lru"), fsync=False).open,
            asyncio.get_running_loop().call_soon_threadsafe)
        tasks = Tasks()
        fetcher = Fetcher(f"http://127.0.0.1:{pport}", store,
                          SpokeMetrics(CollectorRegistry()), spawn=tasks.spawn, deadline=10)
        sizes = {(e.version, 0): e.size for e in entries}
        fetcher.expected_size = lambda ds, key: sizes[key]  # as the spoke does, from manifests
        futs = [fetcher.want("ds", (e.version, 0), 0) for e in entries]
        blocks = await asyncio.gather(*futs)
        for e, b in zip(entries, blocks, strict=True):
            assert xxhash.xxh3_128_digest(b.view) == b.digest and b.size == e.size
        posts = [r for r in proxy.requests if r.startswith(b"POST")]
        asked = [json.loads(r.split(b"\r\n\r\n", 1)[1])["blocks"] for r in posts]
        assert asked[0] == [[e.version, 0] for e in entries]
        assert asked[1:] == [[[e.version, 0] for e in entries[3:]]]  # only what was lost
        await tasks.close()
        await fetcher.close()
        await asyncio.to_thread(store.close)
        assert proxy.server is not None
        proxy.server.close()

    asyncio.run(main())
