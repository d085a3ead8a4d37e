"""The spoke's settings (``spokefs spoke serve``'s options, as one value) and where its
worker processes' sockets live in the cache folder.

Imported by the supervisor (``spoke.workers``), the service and the CLI alike, and importing
nothing of the spoke itself, so none of them imports another through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from spokefs.wire.server import BATCH_MEMORY

if TYPE_CHECKING:
    from spokefs.spoke.upstreams import UpstreamSpec


@dataclass
class SpokeConfig:
    upstream: str                   # the first upstream's URL (the only one, mostly)
    cache_dir: Path
    cache_size: int
    policy: str = "belady"         # announced futures when given, LRU otherwise
    deadline: float = 30.0          # give up on an uncached read after this long
    max_inflight: int = 64          # upstream requests in flight (fill a long link)
    fsync: bool = True
    latest_ttl: float = 10.0        # how long "latest" is trusted before asking upstream
    prefetch: bool = True           # run the planner (readahead, learned working sets, orders)
    prefetch_inflight: int = 256 << 20   # most prefetch bytes outstanding
    pacing: bool = True             # measure the link; keep ~2x bandwidth x RTT of prefetch out
    readahead_max: int = 64 << 20   # largest sequential readahead window per stream
    write_io: str = "auto"          # direct, buffered, or auto (direct for a cache > RAM / 2)
    # A read asks for at most this many bytes beyond what its client has taken, so a slow or
    # abandoned reader of a huge range holds and pulls one window, not the whole range.
    read_window: int = 64 << 20
    # Bytes of batch reads this process holds at once (``wire.server.ByteRoom``): the spoke's
    # budget, shared out among its worker processes (``spoke.workers``).
    batch_memory: int = BATCH_MEMORY
    pin_ttl: float = 24 * 3600.0    # a warm-up's pins are released after this long
    pin_share: float = 0.8          # most of the capacity warm-ups may pin at once
    # Bytes written here (spoke.writeback) and not yet published at the hub, at most: past
    # it, new uploads are refused (507) until the hub has taken some.
    unsafe_quota: int = 64 << 30
    # Commits written through this spoke go into its cache once the hub publishes them; the
    # last this many of each dataset stay pinned (spoke.kept; 0: not put in the cache).
    keep_checkpoints: int = 2
    keep_share: float = 0.5         # most of the capacity those pins may hold
    # Blocks of a file version no snapshot in use holds (changed or removed at the source)
    # leave the cache within this long; 0 keeps them until evicted (retire_stale).
    stale_after: float = 600.0
    auth: str | None = None         # token file clients must present a token of (wire.auth)
    upstream_token_file: str | None = None  # this spoke's own token for its upstream
    # Several upstreams (spoke.upstreams): [{"url", "datasets", "token_file"}, ...] in their
    # order; empty: ``upstream`` alone serves every dataset, with ``upstream_token_file``.
    upstreams: list[dict[str, object]] = field(default_factory=list)
    dataset_config: str | None = None  # per-dataset residency and retention (spoke.datasets)
    tls_cert: str | None = None     # serve https (with tls_key)
    tls_key: str | None = None
    audit_log: str | None = None    # the primary's audit file; replica N's is FILE.worker-N
    # A spoke tier (spoke.tier): static members (URL,URL,...), or a DNS name, or a Kubernetes
    # Service whose members are listed; ``advertise`` is this member's own URL among them.
    tier: str | None = None
    tier_dns: str | None = None
    tier_kubernetes: str | None = None
    advertise: str | None = None
    tier_timeout: float = 10.0      # a member silent this long is skipped for the next one
    tier_refresh: float = 10.0      # how often a DNS or Kubernetes member list is read again
    tier_token_file: str | None = None  # the token presented to members (default: upstream's)
    tier_borrow: int = 128 << 20    # blocks got from other members and not kept, in memory
    tier_copies: bool = True        # keep copies of other members' blocks in spare room
    tier_handoff: float = 600.0     # empty at start, or members changed: ask others first

    def tls(self) -> tuple[Path, Path] | None:
        return (Path(self.tls_cert), Path(self.tls_key)) if self.tls_cert and self.tls_key \
            else None

    def tiered(self) -> bool:
        return bool(self.tier or self.tier_dns or self.tier_kubernetes)

    def tier_token(self) -> str | None:
        """The token this member presents to the other members (their --auth files hold it,
        scope ``tier``): --tier-token-file's, else none. Never the upstream token: the hub's
        credential goes to the hub only, and a member's token opens members' internal
        routes only."""
        if self.tier_token_file is None:
            return None
        from spokefs.wire.auth import read_token_file

        return read_token_file(Path(self.tier_token_file))

    def upstream_specs(self) -> list[UpstreamSpec]:
        """The upstreams in their order, each with its token file (spoke.upstreams)."""
        from spokefs.spoke.upstreams import UpstreamSpec

        if not self.upstreams:
            return [UpstreamSpec(self.upstream, (), self.upstream_token_file)]
        return [UpstreamSpec(str(u["url"]), tuple(u.get("datasets") or ()),  # type: ignore[arg-type]
                             u.get("token_file"))  # type: ignore[arg-type]
                for u in self.upstreams]

    def upstream_tokens(self) -> list[str | None]:
        """The token this spoke presents to each upstream: its own, never a client's."""
        from spokefs.wire.auth import read_token_file

        return [read_token_file(Path(s.token_file)) if s.token_file else None
                for s in self.upstream_specs()]

    def direct_io(self) -> bool:
        """Whether cache writes bypass the page cache. A cache larger than half the memory
        cannot live in the page cache anyway: copying its fills through it only pushes out
        what readers use (and costs a copy, 1-2.6 CPU-s per GiB on a lazily backed VM). A
        smaller one is better kept there: a block read soon after it was fetched is then a
        memory read, not a disk read."""
        if self.write_io == "auto":
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return self.cache_size > memory // 2
        return self.write_io == "direct"


def worker_socket(cache_dir: Path, index: int) -> Path:
    """Where replica worker ``index`` listens for the primary (``before_scrape``)."""
    return cache_dir / f"worker-{index}.sock"


def replica_sockets(cache_dir: Path) -> list[Path]:
    """Every replica worker's socket in the cache folder (of this run or an earlier one)."""
    return sorted(cache_dir.glob("worker-*.sock"))
