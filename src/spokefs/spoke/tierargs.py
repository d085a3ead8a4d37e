"""The ``spokefs spoke serve`` options of a spoke tier (spoke.tier), and their checks."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from spokefs.errors import ConfigError
from spokefs.units import parse_duration, parse_size

log = logging.getLogger(__name__)


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "spoke tier", "several spokes share one cache: each block has one owner (rendezvous "
        "hashing over the members); any member answers any read, asking the owner for what "
        "it does not own; only owners read from the upstream (docs/kubernetes.md)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--tier", metavar="URL,URL,...",
                     help="the members, this one included, each by the URL the others use")
    src.add_argument("--tier-dns", metavar="NAME",
                     help="the members are the addresses NAME resolves to (a headless "
                     "Service), read again every --tier-refresh")
    src.add_argument("--tier-kubernetes", metavar="SERVICE",
                     help="the members are the ready endpoints of SERVICE in this pod's "
                     "namespace (EndpointSlice API), listed then watched")
    g.add_argument("--advertise", metavar="URL",
                   help="this member's URL as the others name it (default: the URL it "
                   "listens on, when that is a fixed address and port)")
    g.add_argument("--tier-timeout", type=parse_duration, default=10.0, metavar="DURATION",
                   help="a member that sends nothing for this long is skipped: its blocks "
                   "are asked of the next member, then the upstream (default 10s)")
    g.add_argument("--tier-refresh", type=parse_duration, default=10.0, metavar="DURATION",
                   help="how often --tier-dns or --tier-kubernetes is read again (default 10s)")
    g.add_argument("--tier-token-file", type=Path, metavar="FILE",
                   help="the token this member presents to the others: a line 'NAME tier "
                   "TOKEN' of every member's --auth file (needed when they ask for tokens; "
                   "the tier's own, never the hub's)")
    g.add_argument("--tier-copies", action=argparse.BooleanOptionalAction, default=True,
                   help="keep a copy of each block got from another member while there is "
                   "room (the next read through this member is local); copies only use room "
                   "this member's own blocks leave free, and leave first (default: on)")
    g.add_argument("--tier-handoff", type=parse_duration, default=600.0, metavar="DURATION",
                   help="after starting with an empty cache (a new member, a replaced node) "
                   "or a change of members, blocks this member owns and lacks are first asked "
                   "of the next member, from its cache, for this long (default 10m; it stops "
                   "early when the others hold no copies; 0 turns it off)")
    g.add_argument("--tier-borrow", type=parse_size, default=128 << 20, metavar="SIZE",
                   help="blocks got from other members and not kept as copies are held in "
                   "memory, up to this much (default 128MiB)")


def tier_config(args: argparse.Namespace, host: str, port: int, tls: bool) -> dict[str, Any]:
    """SpokeConfig fields for the tier options (empty without a tier); ConfigError for a
    tier that cannot work."""
    if not (args.tier or args.tier_dns or args.tier_kubernetes):
        if args.advertise:
            raise ConfigError("--advertise names this member of a tier: give --tier, "
                              "--tier-dns or --tier-kubernetes too")
        return {}
    from spokefs.tier.rendezvous import normalise_url
    from spokefs.tier.sources import parse_static

    advertise = args.advertise
    if advertise is None:
        if port == 0 or host in ("", "0.0.0.0", "::"):
            raise ConfigError("a tier member listening on port 0 or on every address needs "
                              "--advertise URL (its URL as the other members name it)")
        h = f"[{host}]" if ":" in host else host
        advertise = f"{'https' if tls else 'http'}://{h}:{port}"
    advertise = normalise_url(advertise)
    if args.tier:
        members = parse_static(args.tier)
        if advertise not in members:
            log.warning("--advertise %s is not in --tier (%s): it is added, but the other "
                        "members will not count it unless they list it too", advertise,
                        ", ".join(members))
    return {"tier": args.tier, "tier_dns": args.tier_dns,
            "tier_kubernetes": args.tier_kubernetes, "advertise": advertise,
            "tier_timeout": args.tier_timeout, "tier_refresh": args.tier_refresh,
            "tier_token_file": (str(args.tier_token_file.absolute())
                                if args.tier_token_file else None),
            "tier_borrow": args.tier_borrow, "tier_copies": args.tier_copies,
            "tier_handoff": args.tier_handoff}
