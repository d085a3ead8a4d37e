"""This spoke as a member of a spoke tier (``spoke.tier``): its ``Tier`` made from the
configuration, the copies of other members' blocks told apart from its own when members
join or leave, the handoff opened then, and the tier's part of ``/v1/status``.

The index does not record which blocks are copies: the member asks the ranking at start and
whenever the members change (``reclassify``, in slices), so a copy whose owner left becomes
an owned block and the reverse (docs/architecture.md, "A spoke tier").
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from spokefs.cache.store import BlockStore
from spokefs.errors import ConfigError
from spokefs.spoke.config import SpokeConfig
from spokefs.spoke.tier import Tier, make_lookup
from spokefs.tasks import Tasks
from spokefs.units import format_size

log = logging.getLogger(__name__)


def make_tier(config: SpokeConfig, registry: CollectorRegistry) -> Tier:
    from spokefs.tier.sources import parse_static

    if config.advertise is None:
        raise ConfigError("a spoke tier needs --advertise URL (this member's URL as the "
                          "others name it)")
    members = parse_static(config.tier) if config.tier else [config.advertise]
    lookup, source = make_lookup(config.tier_dns, config.tier_kubernetes, config.advertise)
    return Tier(config.advertise, members, registry, token=config.tier_token(),
                timeout=config.tier_timeout, lookup=lookup, source=source,
                refresh=config.tier_refresh, borrow_bytes=config.tier_borrow,
                max_connections=config.max_inflight,
                # half the deadline: then the blocks are asked elsewhere in time
                wait_limit=config.deadline / 2)


class Member:
    """The spoke's side of its tier: copies and handoffs as the members change."""

    def __init__(self, tier: Tier, store: BlockStore, tasks: Tasks, handoff: float) -> None:
        self.tier = tier
        self.store = store
        self.tasks = tasks
        self.handoff = handoff  # --tier-handoff: how long other members are asked first

    def start(self) -> None:
        tier = self.tier
        # The index knows no owner (copies): ask the ranking now and whenever it changes.
        tier.on_change = self.members_changed
        if self.store.policy.keeps_copies:
            self.tasks.spawn(self.reclassify_copies(), "tier-copies")
        if self.store.data_bytes == 0:  # a new member, or a replaced node's empty disk
            tier.open_handoff(self.handoff)
        self.tasks.keep(tier.probe_loop, "tier-probes")
        if tier.lookup is not None:
            self.tasks.keep(tier.refresh_loop, "tier-members")

    def members_changed(self) -> None:
        """Members joined or left: shares moved (copies may now be owned, and the reverse),
        and blocks this member now owns are likely held by others: a handoff."""
        if self.store.policy.keeps_copies:
            self.tasks.spawn(self.reclassify_copies(), "tier-copies")
        self.tier.open_handoff(self.handoff)

    async def reclassify_copies(self) -> None:
        """Which cached blocks are copies of other members' blocks (they leave first) and
        which this member owns, by the ranking: at start (the index does not say) and when
        members join or leave. In slices: millions of blocks, readers go on meanwhile."""
        policy = self.store.policy
        router = self.tier.router
        keys = policy.resident_keys()
        moved = 0
        for i in range(0, len(keys), 20_000):
            moved += policy.reclassify(keys[i:i + 20_000],
                                       lambda key: router.owner(key) != router.self_url)
            await asyncio.sleep(0)
        if moved:
            log.info("tier: %d cached blocks changed class (copies of other members' blocks "
                     "leave first; %s of copies now)", moved, format_size(policy.copy_bytes))

    def status(self) -> dict[str, object]:
        policy = self.store.policy
        copies = policy.copy_bytes if policy.keeps_copies else None
        return {**self.tier.status(), "copies": copies is not None, "copy_bytes": copies or 0}
