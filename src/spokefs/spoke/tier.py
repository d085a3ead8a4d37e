"""The spoke tier's data path: which route each block takes, and a client per member.

Several spokes in one region share one cache. Each block has one owner, chosen by rendezvous
hashing over every listed member (``spokefs.tier.rendezvous``); a member that misses a block
it does not own asks the owner for it with a batch read (``POST /v1/datasets/{ds}/blocks``)
marked ``X-Spokefs-Peer``, and only the owner fetches from the upstream. A marked request is
served from the answering member's cache or its upstream, never from another member, so a
block crosses at most one member-to-member hop even while two members disagree about the
member list.

Two parts:

- ``TierRouter`` (no I/O): the member list and its health (``spokefs.tier.membership``) and,
  per block, the route: a member to ask, or the upstream, and whether this member keeps the
  block. A member that does not answer is skipped (the next member in the block's ranking,
  then this member itself fetching from the upstream), so a member going down never fails a
  read.
- ``Tier`` (I/O): a ``DataClient`` per member, the refresh of the member list from DNS or
  Kubernetes (look-ups in a thread), probes of members that are down, per-member counters and
  the ``tier`` part of ``/v1/status``.

What a member keeps: blocks it owns (or fetched from the upstream because the owners before
it in the ranking were down, or because another member asked it as their owner). Blocks it
got from another member are served and then kept as *copies* in room its own blocks leave
free (``--tier-copies``, on by default; ``spokefs.policy.CopiesFirst``): a copy is admitted
only by evicting other copies and leaves before any owned block, so the next read through
this member is local while the disks have room, and the tier still holds one regional copy
of each block once they do not: the sum of the members' disks stays the tier's capacity.
A block not kept as a copy is held in memory, in a small window (``borrow_bytes``, most
recently used first), so the read that follows a prefetch or a same-host mount's
``locate`` finds it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from spokefs.errors import BadRequest, ConfigError, SpokeError, Transient
from spokefs.policy import BlockKey
from spokefs.tier.membership import Membership, State
from spokefs.tier.rendezvous import Rendezvous, normalise_url
from spokefs.wire.backend import PEER_KEY
from spokefs.wire.client import UpstreamClient
from spokefs.wire.headers import H_MEMBER, H_PEER
from spokefs.wire.http1 import DataClient, Patience

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger(__name__)

PEER_KINDS = ("demand", "prefetch", "copy")  # copy: from the cache only (a handoff)


@dataclass(frozen=True, slots=True)
class Peer:
    """A batch read another member sent (``X-Spokefs-Peer``): served from the cache or the
    upstream only, never a third member (``demand``, or ``prefetch`` at a prefetch's
    priority), or from the cache only (``copy``: a handoff). ``member``: the asker's URL
    (``X-Spokefs-Member``): it lacks the blocks it asks for, so a handoff for them does not
    ask it back."""

    kind: str
    member: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in PEER_KINDS:
            raise BadRequest(f"{H_PEER} must be one of {', '.join(PEER_KINDS)}, not "
                             f"{self.kind[:40]!r}")


@dataclass(frozen=True, slots=True)
class Route:
    """Where a block is asked for (``peer``: a member's URL; None: the upstream) and whether
    this member keeps it once it arrives. ``handoff``: this member owns it, and asks another
    member for a copy it may hold (from its cache only) before the upstream."""

    peer: str | None
    keep: bool
    handoff: bool = False


UPSTREAM_KEEP = Route(None, True)


class TierRouter:
    """The member list, its health and each block's route (sans-I/O: the clock is passed in).

    Ownership is computed over every listed member, answering or not (a member that stops
    answering keeps its share; its blocks are asked of the next member meanwhile), so a
    member that comes back serves its share from the cache it kept."""

    HANDOFF_TRIAL = 64  # handoff blocks asked before judging whether copies are there

    def __init__(self, self_url: str, members: Iterable[str], now: float, *,
                 down_failures: int = 3, down_after: float = 5.0, retry_after: float = 1.0,
                 retry_max: float = 30.0) -> None:
        self.self_url = normalise_url(self_url)
        self.handoff_until = 0.0
        self._handoff_asked = self._handoff_found = 0
        self.membership = Membership(members, now, self_url=self.self_url,
                                     down_failures=down_failures, down_after=down_after,
                                     retry_after=retry_after, retry_max=retry_max)
        self._rdv = Rendezvous(self.membership.members)

    @property
    def members(self) -> list[str]:
        return self.membership.members

    def update(self, members: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """A new member list (from a source); (added, removed)."""
        added, removed = self.membership.update(members, now)
        if added or removed:
            self._rdv = Rendezvous(self.membership.members)
        return added, removed

    def owner(self, key: BlockKey) -> str:
        return self._rdv.owner(key[0], key[1])

    def route(self, key: BlockKey, now: float, tried: Iterable[str] = (),
              direct: bool = False) -> Route:
        """The route of block ``key``. ``direct``: a member asked for it (from the cache or
        the upstream only, kept: the asker takes this member for its owner). ``tried``:
        members that failed this block already. Down the block's ranking, skipping down and
        tried members: the first other member is asked; reaching this member means fetching
        from the upstream and keeping the block (owner, or the next owner while the ones
        before it are away), or, during a handoff, first asking the next member for a copy."""
        skip = set(tried)
        ranked = self.membership.candidates(self._rdv.ranked(key[0], key[1]), now)
        if not direct:
            for url in ranked:
                if url == self.self_url:
                    break
                if url not in skip:
                    return Route(url, False)
        if self.handoff_until > now:  # a member answering well: a hop that may save the WAN
            for url in ranked:
                if (url != self.self_url and url not in skip
                        and self.membership.state(url, now) is State.UP):
                    return Route(url, True, handoff=True)
        return UPSTREAM_KEEP

    # -- handoff: a member whose share is not in its cache asks the others for copies -------
    def open_handoff(self, now: float, seconds: float) -> None:
        """For ``seconds``, a block this member must fetch from the upstream is first asked of
        the next member in its ranking, from that member's cache only: a member that started
        empty (a replaced node) or whose share grew (members left or joined) takes blocks
        the others hold as copies, or held as owners, over the local network, not the WAN.
        Closed early when copies are not there (``handoff_result``)."""
        self.handoff_until = max(self.handoff_until, now + seconds)
        self._handoff_asked = self._handoff_found = 0

    def handoff_result(self, found: bool) -> None:
        """The answer to one handoff block; after 64, under 1 in 10 found closes the handoff
        (a tier filling cold holds no copies: each ask would be a wasted hop)."""
        self._handoff_asked += 1
        self._handoff_found += found
        if (self._handoff_asked >= self.HANDOFF_TRIAL
                and self._handoff_found * 10 < self._handoff_asked):
            self.handoff_until = 0.0

    def shares(self) -> dict[str, float]:
        return self._rdv.shares()

    # -- outcomes (Membership's events) ------------------------------------------------------
    def answered(self, url: str, now: float) -> None:
        self.membership.answered(url, now)

    def failed(self, url: str, now: float, timed_out: bool = False) -> None:
        if timed_out:
            self.membership.timed_out(url, now)
        else:
            self.membership.failed(url, now)

    def state(self, url: str, now: float) -> State | None:
        return self.membership.state(url, now)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return self.membership.snapshot(now, self.shares())


class TierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("spokefs_tier_peer_requests", "Batch reads sent to other tier "
                                "members, by outcome (answered, failed, timed_out)",
                                ["peer", "outcome"], registry=r)
        self.blocks = Counter("spokefs_tier_peer_blocks", "Blocks received from other tier "
                              "members (checked against their digests)", ["peer"], registry=r)
        self.bytes = Counter("spokefs_tier_peer_bytes", "Bytes received from other tier "
                             "members", ["peer"], registry=r)
        self.rerouted = Counter("spokefs_tier_rerouted_blocks", "Blocks asked of the next "
                                "member or the upstream because a member failed them",
                                ["peer"], registry=r)
        self.waited = Counter("spokefs_tier_peer_waits", "Times a member that had sent "
                              "nothing for nearly --tier-timeout answered a probe and was "
                              "waited for (busy on its own upstream, not gone)", ["peer"],
                              registry=r)
        self.served = Counter("spokefs_tier_served_bytes", "Bytes this member served to other "
                              "members' batch reads", registry=r)
        self.members = Gauge("spokefs_tier_members", "Listed tier members by state",
                             ["state"], registry=r)
        self.handoff = Counter("spokefs_tier_handoff_blocks", "Blocks this member owns that "
                               "it asked another member for (a copy, from its cache only) "
                               "before the upstream, by outcome (found, not_found)",
                               ["outcome"], registry=r)


# A source's look-up: the member list now (blocking; run in a thread). None: static.
Lookup = Callable[[], list[str]]


class Tier:
    """The I/O around ``TierRouter``: member clients, list refresh, probes, counters."""

    def __init__(self, self_url: str, members: Iterable[str], registry: CollectorRegistry, *,
                 token: str | None, timeout: float = 10.0, max_connections: int = 32,
                 lookup: Lookup | None = None, source: str = "static",
                 refresh: float = 10.0, borrow_bytes: int = 128 << 20,
                 wait_limit: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout <= 0 or refresh <= 0:
            raise ConfigError("--tier-timeout and --tier-refresh must be positive")
        self.clock = clock
        self.router = TierRouter(self_url, members, clock())
        self.self_url = self.router.self_url
        self.token = token
        self.timeout = timeout
        self.max_connections = max_connections
        self.lookup = lookup
        self.source = source
        self.refresh = refresh
        self.borrow_bytes = borrow_bytes
        self.wait_limit = wait_limit  # how long a silent owner that answers is waited for
        self._alive: dict[str, tuple[float, asyncio.Future[bool]]] = {}
        self.on_change: Callable[[], None] | None = None  # the member list changed
        self.metrics = TierMetrics(registry)
        for st in State:
            self.metrics.members.labels(str(st)).set_function(
                lambda st=st: sum(self.router.state(u, self.clock()) is st
                                  for u in self.router.members))
        self._clients: dict[str, DataClient] = {}
        self.last_refresh_error: str | None = None
        # Blocks other members delivered lately: they hold them (residency, the planner).
        self.delivered: OrderedDict[BlockKey, None] = OrderedDict()
        self.delivered_max = 1_000_000

    # -- routing -----------------------------------------------------------------------------
    def route(self, key: BlockKey, tried: Iterable[str] = (), direct: bool = False) -> Route:
        return self.router.route(key, self.clock(), tried, direct)

    def open_handoff(self, seconds: float) -> None:
        if seconds > 0:
            self.router.open_handoff(self.clock(), seconds)
            log.info("tier: for %gs, blocks this member must fetch are first asked of the "
                     "next member (copies it may hold)", seconds)

    def handoff_result(self, found: bool) -> None:
        self.metrics.handoff.labels("found" if found else "not_found").inc()
        was_open = self.router.handoff_until > self.clock()
        self.router.handoff_result(found)
        if was_open and self.router.handoff_until <= self.clock():
            log.info("tier: handoff closed: the other members hold few copies of this "
                     "member's share (a tier filling cold); blocks go to the upstream")

    def client(self, url: str) -> DataClient:
        c = self._clients.get(url)
        if c is None:
            # Members are on the local network: a connection that takes seconds is a member
            # that is gone. idle_timeout bounds a member that accepted and went silent; a
            # member answers a batch once all of it is in (its WAN may be slow), so it counts
            # as silent only while none of our requests to it brings a byte (idle_any).
            c = self._clients[url] = DataClient(
                url, max_connections=self.max_connections, idle_timeout=self.timeout,
                connect_timeout=min(2.0, self.timeout), token=self.token, idle_any=True)
        return c

    def patience(self, url: str, superseded: Callable[[], bool] | None = None) -> Patience:
        """For a read of blocks ``url`` owns, which it fetches from its upstream for us:
        silent, it is still waited for while it answers a probe, up to ``wait_limit``, since
        asking the upstream ourselves would bring the blocks across the WAN twice; until
        ``superseded()`` (the caller then asks ``url`` again another way)."""
        return Patience(functools.partial(self.alive, url), self.wait_limit,
                        self.probe_timeout, superseded)

    @property
    def probe_timeout(self) -> float:
        """How long a member has to answer a probe: on the local network, a second at most
        (a third of --tier-timeout when that is shorter)."""
        return min(1.0, self.timeout / 3)

    async def alive(self, url: str) -> bool:
        """Whether ``url``'s primary answers a request now (any status); the requests that
        go silent together share one probe, and its answer counts for a second."""
        now = self.clock()
        known = self._alive.get(url)
        if known is None or (known[1].done() and now - known[0] > 1.0):
            fut = asyncio.ensure_future(self._answers(url))
            known = self._alive[url] = (now, fut)
        answered = await asyncio.shield(known[1])
        if answered:
            self.metrics.waited.labels(url).inc()
            log.debug("tier member %s sends nothing but answers: still waiting", url)
        return answered

    async def _answers(self, url: str, timeout: float | None = None) -> bool:
        """Whether ``url``'s primary answers ``GET /v1/status`` (any status: a refusal is an
        answer too; the primary answers it without its upstream) within ``timeout``."""
        timeout = self.probe_timeout if timeout is None else timeout
        client = UpstreamClient(url, max_connections=1, request_timeout=timeout,
                                token=self.token)
        try:
            async with asyncio.timeout(timeout):  # the connect too
                await client.forward("GET", "/v1/status", {}, b"")
        except (TimeoutError, Transient, SpokeError) as exc:  # no answer in time, or none
            log.debug("tier probe of %s failed: %s", url, exc)
            return False
        finally:
            await client.close()
        return True

    @property
    def last_received(self) -> float:
        return max((c.last_received for c in self._clients.values()), default=0.0)

    def answered(self, url: str, nbytes: int, blocks: int) -> None:
        self.router.answered(url, self.clock())
        self.metrics.requests.labels(url, "answered").inc()
        self.metrics.bytes.labels(url).inc(nbytes)
        self.metrics.blocks.labels(url).inc(blocks)

    def failed(self, url: str, cause: str, rerouted: int) -> None:
        timed_out = cause.startswith("no byte from")  # DataClient's idle timeout
        before = self.router.state(url, self.clock())
        self.router.failed(url, self.clock(), timed_out)
        self.metrics.requests.labels(url, "timed_out" if timed_out else "failed").inc()
        self.metrics.rerouted.labels(url).inc(rerouted)
        after = self.router.state(url, self.clock())
        if after is not before:
            log.warning("tier member %s is %s (%s); its blocks go to the next member",
                        url, after, cause, extra={"event": "tier_member", "member": url,
                                                  "state": str(after)})

    def rerouted(self, url: str, n: int) -> None:
        self.metrics.rerouted.labels(url).inc(n)

    def got(self, key: BlockKey) -> None:
        """A member delivered ``key``: it holds the block (bounded memory of that)."""
        d = self.delivered
        d[key] = None
        d.move_to_end(key)
        while len(d) > self.delivered_max:
            d.popitem(last=False)

    # -- background: list refresh and probes ---------------------------------------------------
    async def refresh_loop(self) -> None:
        """Re-read the member list every ``refresh`` seconds (a failed look-up keeps the last
        list: forgetting every member at once would move every share)."""
        assert self.lookup is not None
        lookup = self.lookup
        wait = getattr(lookup, "wait_changed", None)  # a watch: woken by its changes
        seen = 0
        while True:
            try:
                members = await asyncio.to_thread(lookup)
            except (OSError, ConfigError, ValueError) as exc:
                if self.last_refresh_error is None:
                    log.warning("tier: cannot list the members (%s); keeping the last list",
                                exc, extra={"event": "tier_refresh_failed"})
                self.last_refresh_error = str(exc)
            else:
                self.last_refresh_error = None
                self.apply(members)
            if wait is None:
                await asyncio.sleep(self.refresh)
            else:  # as soon as the watch changes the list, at most ``refresh`` later
                seen = await asyncio.to_thread(wait, seen, self.refresh)

    def apply(self, members: list[str]) -> None:
        added, removed = self.router.update(members, self.clock())
        if added or removed:
            log.info("tier members changed: +%s -%s (%d members)", added or "[]",
                     removed or "[]", len(self.router.members),
                     extra={"event": "tier_members", "added": added, "removed": removed})
            if self.on_change is not None:
                self.on_change()
        for url in removed:
            c = self._clients.pop(url, None)
            if c is not None:
                asyncio.get_running_loop().create_task(c.close())

    async def probe_loop(self) -> None:
        """Ask down members for their status when their probe is due; the first answer makes
        one up again (and its share comes back to it)."""
        while True:
            now = self.clock()
            for url in self.router.membership.probes_due(now):
                asyncio.get_running_loop().create_task(self._probe(url))
            nxt = self.router.membership.next_deadline(now)
            await asyncio.sleep(0.5 if nxt is None else min(0.5, max(0.05, nxt - now)))

    async def _probe(self, url: str) -> None:
        if not await self._answers(url, min(2.0, self.timeout)):
            self.router.failed(url, self.clock())
            return
        self.router.answered(url, self.clock())
        log.info("tier member %s answers again; it takes its share back", url,
                 extra={"event": "tier_member", "member": url, "state": "up"})

    async def close(self) -> None:
        close = getattr(self.lookup, "close", None)  # a watch's thread
        if close is not None:
            close()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    def status(self) -> dict[str, object]:
        return {"self": self.self_url, "source": self.source,
                "refresh_error": self.last_refresh_error,
                "members": self.router.snapshot(self.clock())}


def make_lookup(config_dns: str | None, config_kubernetes: str | None,
                advertise: str) -> tuple[Lookup | None, str]:
    """The look-up for ``--tier-dns`` or ``--tier-kubernetes`` (port and scheme: this
    member's advertised URL's); (None, "static") for neither."""
    from urllib.parse import urlsplit

    from spokefs.tier import sources

    u = urlsplit(advertise)
    scheme = u.scheme
    port = u.port or (443 if scheme == "https" else 80)
    if config_dns:
        name = config_dns
        return (lambda: sources.resolve_dns(name, port, scheme)), "dns"
    if config_kubernetes:
        # A list, then a watch (lightkube, in a thread of its own): each refresh reads memory.
        return sources.KubernetesMembers(config_kubernetes, scheme=scheme, port=port), \
            "kubernetes"
    return None, "static"


def request_peer(request: web.Request) -> Peer | None:
    """The ``Peer`` a request's ``X-Spokefs-Peer`` and ``X-Spokefs-Member`` describe (None:
    not a member's); a bad one is a 400."""
    kind = request.headers.get(H_PEER)
    if kind is None:
        return None
    Peer(kind)  # the kind is checked first
    asker = request.headers.get(H_MEMBER)
    try:
        asker = normalise_url(asker) if asker else None
    except (ConfigError, ValueError):
        raise BadRequest(f"{H_MEMBER} must be a member's URL") from None
    return Peer(kind, asker)


@web.middleware
async def peer_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks a request another member sent (``X-Spokefs-Peer``) for the spoke's batch reads
    (``request[PEER_KEY]``, which the API passes on): they are then served from the cache or
    the upstream only."""
    peer = request_peer(request)
    if peer is not None:
        request[PEER_KEY] = peer
    return await handler(request)
