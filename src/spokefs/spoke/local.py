"""Other processes on this host that read the spoke's cache files themselves: its replica
workers (``spoke.replica``) and same-host mounts (``mount.source``).

They ask where blocks are (``locate``: fetching missing ones first, as demand, when asked),
hear of blocks that became resident since they last asked (``news``), report the reads they
served (``reads_elsewhere``: the planner hears them, the eviction order and the counts take
them, as if this spoke had served them), report bytes that failed their check (``recheck``),
and, for replica workers, their counts (``add_counts``, gathered before every scrape:
``before_scrape``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter

from spokefs.cache.feed import ResidencyFeed
from spokefs.cache.store import BlockStore, Loc
from spokefs.errors import SpokeError, Transient
from spokefs.integrity import DEFAULT_BLOCK_SIZE, blocks_in_range
from spokefs.policy import BlockKey
from spokefs.spoke.config import replica_sockets
from spokefs.spoke.fetcher import Block
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.reads import DEMAND, Reads
from spokefs.wire.backend import DatasetVersions, ReadContext
from spokefs.wire.client import UpstreamClient

log = logging.getLogger(__name__)


class SameHost:
    """What the spoke tells, and hears from, readers of its cache files on this host.
    ``block_size(dataset)``: the dataset's block size if known (no I/O)."""

    NEWS_LIMIT = 1024  # feed entries looked at per answer (~1 ms to encode)

    def __init__(self, store: BlockStore, reads: Reads, versions: DatasetVersions,
                 metrics: SpokeMetrics, block_size: Callable[[str], int | None]) -> None:
        self.store = store
        self.reads = reads
        self.versions = versions
        self.metrics = metrics
        self.block_size = block_size
        # The API's served-bytes counter (``attach_served``): replica workers' bytes add up
        # there, so /metrics speaks for the whole spoke.
        self.served: Counter | None = None
        # Blocks that became resident lately, told to same-host readers (locate, reads).
        self.feed: ResidencyFeed[BlockKey, Loc] = ResidencyFeed()
        store.events.changed.append(lambda key, loc: loc is not None and self.feed.add(key, loc))

    def cache_info(self) -> dict[str, object]:
        return {"dir": str(self.store.root.resolve()), "id": self.store.instance,
                "chunk_size": self.store.chunk_size}

    async def locate(self, name: str, keys: list[BlockKey], fetch: bool,
                     ctx: ReadContext | None = None, span: tuple[int, int] | None = None
                     ) -> list[dict[str, object] | None]:
        """Where each block is in the cache (spokefs.cache.shared), None where it is not.
        With ``fetch``, missing blocks are fetched first (as demand) and written; a block the
        cache could not keep stays None (the caller reads it through the spoke). ``ctx`` and
        ``span`` describe the read, for the planner, and make it count: a hit or a miss per
        block, as if this spoke had served it (what a replica or a mount reads elsewhere is
        part of what the spoke does)."""
        reads = self.reads
        for version in dict.fromkeys(v for v, _ in keys):
            await self.versions.check(name, version)
        if ctx is not None and span is not None and reads.heard is not None and keys:
            reads.heard(name, keys[0][0], span[0], span[1], ctx)
        for key in keys:
            reads.expired(key)  # what the rules no longer allow is not located, but fetched
        waits: dict[BlockKey, asyncio.Future[Block]] = {}
        if fetch:
            for k in keys:
                if k not in waits and (fut := reads.ask(name, k)) is not None:
                    waits[k] = fut
        if ctx is not None:
            reads.counts.count(name, len(keys) - len(waits), len(waits))
        out: list[dict[str, object] | None] = []
        for key in keys:
            loc = self.store.get(key)
            if loc is None and fetch:
                block = reads.fetches.recent(key)
                if block is None:
                    fut = waits.get(key) or reads.fetch(name, key, DEMAND)
                    block = await reads.wait(fut, f"block {key[1]} of {key[0]} ({name})",
                                             name)
                if block.written is not None:
                    await asyncio.shield(block.written)
                loc = self.store.get(key)
            out.append(None if loc is None else self.loc_doc(key, loc, key in waits))
        return out

    def loc_doc(self, key: BlockKey, loc: Loc, fetched: bool = False) -> dict[str, object]:
        return {"seg": loc.seg.id, "offset": loc.offset, "size": loc.size,
                "digest": loc.digest.hex(), "chunks": loc.chunks.hex(),
                "object_size": self.store.object_size(key[0]), "fetched": fetched}

    def news(self, name: str, cursor: int) -> dict[str, object]:
        """Blocks of dataset ``name`` that became resident after ``cursor`` (and are still
        where they were put), for a same-host reader to know before it asks: ``{"cursor":
        ask with this next, "blocks": [[version, index, location], ...], "more": bool}``."""
        entries, nxt = self.feed.since(cursor, self.NEWS_LIMIT)
        blocks = [[k[0], k[1], self.loc_doc(k, loc)] for k, loc in entries
                  if loc.dataset == name and self.store.get(k) is loc]
        return {"cursor": nxt, "blocks": blocks, "more": nxt < self.feed.end}

    def recheck(self, keys: list[BlockKey]) -> None:
        """Another process found these blocks' bytes wrong: check them here; a damaged one
        is dropped and counted (and fetched again by whoever asks next)."""
        for key in keys:
            loc = self.store.get(key)
            if loc is not None:
                self.store.read(key, 0, loc.size)

    def reads_elsewhere(self, name: str, reads: list[tuple[str, int, int, ReadContext]],
                        by_mount: bool = False, extra_bytes: int = 0) -> None:
        """Reads served by another process from the cache (version, start, end, context):
        the planner learns from them as from its own, and each block counts as a hit; the
        bytes count as served (a replica worker's) or short-circuited (a mount's)."""
        bs = self.block_size(name) or DEFAULT_BLOCK_SIZE
        heard, counts = self.reads.heard, self.reads.counts
        nbytes = extra_bytes
        for version, start, end, ctx in reads:
            if end > start:
                nbytes += end - start
                n = 0
                for i in blocks_in_range(start, end, bs):
                    self.store.touch((version, i))
                    n += 1
                counts.count(name, n, 0)
            if heard is not None:
                heard(name, version, start, end, ctx)
        if by_mount:
            self.metrics.short_circuit_bytes.inc(nbytes)
        elif self.served is not None:
            self.served.inc(nbytes)

    def add_counts(self, counts: dict[str, int]) -> None:
        """What a replica worker counted since it last said (bytes served; its hits and
        misses come with its reads and locates): /metrics shows the whole spoke."""
        if self.served is not None:
            self.served.inc(max(0, int(counts.get("served_bytes", 0))))

    async def before_scrape(self) -> None:
        """Ask every replica worker to report what it counted, so /metrics and /v1/status
        are exact at the moment they are read (a replica reports every 50 ms otherwise)."""
        async def flush(path: Path) -> None:
            client = UpstreamClient("http://spoke-replica", max_connections=1, token=None,
                                    request_timeout=2.0, unix_socket=str(path))
            try:
                await client.post_json("/v1/workers/flush", {})
            except (Transient, SpokeError) as exc:  # restarting, or gone: its counts wait
                log.debug("replica %s did not report: %s", path.name, exc)
            finally:
                await client.close()

        socks = replica_sockets(self.store.root)
        if socks:
            await asyncio.gather(*(flush(p) for p in socks))
