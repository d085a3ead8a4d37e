"""What leaves the spoke's cache besides eviction: stale file versions, purges, and blocks
their dataset's rules (``--dataset-config``: cache deny, time to live, share of the cache)
no longer allow.

- Stale versions (``--stale-after``): blocks of file versions no snapshot in use holds (the
  source changed or removed the file) leave within ``stale_after``. In use: each dataset's
  latest snapshot and every snapshot a reader named lately (``spoke.metadata``). Warm-up pins
  hold their blocks; a dataset whose latest the upstream cannot confirm keeps its blocks:
  nothing leaves on a guess.
- Purges: all, a dataset's, its versions in none of the kept snapshots, or named versions.
- Rules: a fetched block is kept only if its dataset's rules admit it (``admit``); a
  resident one past its time to live, or of a dataset denied since, is dropped when read
  (``expired``) and in a pass every few seconds (``enforce``), so a same-host reader of the
  cache files, which does not ask, is held to the rules too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container

from spokefs.audit import Audit
from spokefs.cache.store import BlockStore
from spokefs.errors import BadRequest, SpokeError
from spokefs.policy import BlockKey
from spokefs.spoke.datasets import DatasetConfig
from spokefs.spoke.metadata import Metadata
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.units import format_size

log = logging.getLogger(__name__)


class Retention:
    """Stale versions, purges and per-dataset rules. ``pinned``: blocks warm-ups hold (they
    stay, stale or not). ``clock``: for the snapshots in use (monotonic); ``wall``: for a
    block's age (the index keeps wall-clock times)."""

    def __init__(self, store: BlockStore, metadata: Metadata, rules: DatasetConfig,
                 metrics: SpokeMetrics, audit: Audit, pinned: Container[BlockKey], *,
                 stale_after: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.metadata = metadata
        self.rules = rules
        self.metrics = metrics
        self.audit = audit
        self.pinned = pinned
        self.stale_after = stale_after
        self.clock = clock
        self.wall = wall
        self._retired_for: dict[str, frozenset[str]] = {}  # dataset -> in-use set at last pass
        self.passes = 0

    # -- per-dataset rules -------------------------------------------------------------------
    def admit(self, dataset: str, size: int) -> bool:
        """Whether a fetched block of ``dataset`` may be kept (else it is served only)."""
        rules = self.rules.get(dataset)
        if not rules.cache:
            return False
        if rules.max_share is not None:
            limit = rules.max_share * self.store.capacity
            held = (self.store.dataset_bytes.get(dataset, 0)
                    + self.store.dataset_reserved.get(dataset, 0))  # being written counts
            return held + size <= limit
        return True

    def expired(self, key: BlockKey) -> bool:
        """A resident block its dataset's rules no longer let be served (past its time to
        live, or caching denied since): dropped now, so it is fetched again."""
        loc = self.store.get(key)
        if loc is None:
            return False
        rules = self.rules.get(loc.dataset)
        if rules.cache and (rules.ttl is None or self.wall() - loc.stored <= rules.ttl):
            return False
        self.store.drop(key, "ttl" if rules.cache else "cache denied")
        return True

    async def enforce(self) -> None:
        """Drop every block past its time to live or of a dataset now denied."""
        if not self.rules.any_ttl_or_deny:
            return
        for n, key in enumerate(list(self.store.keys())):
            self.expired(key)
            if n % 20_000 == 19_999:
                await asyncio.sleep(0)

    # -- purges ------------------------------------------------------------------------------
    async def purge(self, name: str | None, keep: list[str] | None = None) -> int:
        """Drop cached blocks: all, a dataset's, or (``keep``: snapshot ids or "latest") a
        dataset's blocks of file versions in none of those snapshots -- what a source change
        left behind (rewritten or deleted files), without touching the current ones."""
        versions: set[str] = set()
        if keep is not None:
            if name is None:
                raise BadRequest("purging by kept snapshots needs a dataset")
            md = self.metadata
            for snap in keep:
                m = await md.manifest(name, await md.resolve(name, snap))
                versions.update(m.versions)
        else:
            self.store.forget_writes(name)  # and what is in flight stays out too
        return await self.drop_all(self.store.purge_keys(name, versions))

    async def purge_versions(self, name: str, versions: set[str]) -> int:
        """Drop the cached blocks of these file versions (named files or folders, now)."""
        return await self.drop_all([k for k in self.store.purge_keys(name) if k[0] in versions])

    async def drop_all(self, keys: list[BlockKey], reason: str = "purge") -> int:
        """Drop blocks (a purge, or stale versions); the bytes freed."""
        if reason == "purge":
            self.audit.purging(keys)  # their removals are recorded as purged
        freed = 0
        for n, key in enumerate(keys):
            freed += self.store.size_of(key)
            self.store.drop(key, reason)
            if n % 2000 == 1999:
                await asyncio.sleep(0)  # a big purge must not stop every reader meanwhile
        # Done means done: the space is free and the index says so when this returns.
        await asyncio.to_thread(self.store.worker.flush)
        return freed

    # -- stale versions ----------------------------------------------------------------------
    @property
    def period(self) -> float:
        return max(1.0, min(60.0, self.stale_after / 4))

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.retire_stale()

    async def retire_stale(self) -> int:
        """Drop the cached blocks of file versions no snapshot in use holds -- files the
        source changed or removed -- so they leave within ``stale_after``; the bytes freed.

        In use: each dataset's latest snapshot and every snapshot a reader named (a read, a
        manifest, an order, a warm-up, a mount's or replica's report) within the last
        ``stale_after`` less one pass. Warm-up pins hold their blocks. A dataset is skipped
        while the upstream cannot confirm its latest snapshot or a manifest in use cannot be
        loaded: nothing leaves on a guess. A pass over a dataset whose in-use set did not
        change since the last one costs nothing (only reads of a snapshot bring its blocks,
        and a read marks it in use)."""
        now = self.clock()
        window = self.stale_after - self.period
        md = self.metadata
        used = md.used
        for key in [k for k, t in used.items() if now - t > window]:
            del used[key]
        freed = 0
        for ds in [d for d, n in self.store.dataset_bytes.items() if n > 0]:
            try:
                info = await md.dataset(ds)
                if info.latest is None or ds in md.unconfirmed:
                    continue
                snaps = frozenset({info.latest, *(s for d, s in used if d == ds)})
                if self._retired_for.get(ds) == snaps:
                    continue
                keep: set[str] = set()
                for snap in snaps:
                    keep.update((await md.manifest(ds, snap)).versions)
            except SpokeError as exc:
                log.debug("stale blocks of %s stay for now: %s", ds, exc)
                continue
            keys = []
            for n, key in enumerate(list(self.store.keys())):
                if n % 50_000 == 49_999:
                    await asyncio.sleep(0)  # millions of blocks: readers go on meanwhile
                if key[0] in keep or key in self.pinned:
                    continue
                loc = self.store.get(key)
                if loc is not None and loc.dataset == ds:
                    keys.append(key)
            if keys:
                n = await self.drop_all(keys, "stale")
                freed += n
                self.metrics.stale_blocks.inc(len(keys))
                log.info("%s: dropped %d blocks (%s) of file versions no snapshot in use holds "
                         "(changed or removed at the source)", ds, len(keys), format_size(n))
            self._retired_for[ds] = snaps
        self.passes += 1
        return freed

    def status(self) -> dict[str, object]:
        """What keeps old file versions cached: the snapshots in use, per dataset."""
        now = self.clock()
        in_use: dict[str, list[str]] = {}
        for (ds, snap), t in sorted(self.metadata.used.items()):
            if now - t <= self.stale_after:
                in_use.setdefault(ds, []).append(snap)
        return {"after_s": self.stale_after, "passes": self.passes,
                "snapshots_in_use": in_use}
