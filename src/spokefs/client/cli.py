"""Client commands: ``warm``, ``status``, ``top``, ``purge``, ``inventory``, ``ls``, ``cat``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spokefs.units import format_size, parse_duration

if TYPE_CHECKING:
    from spokefs.client.control import Missing

DEFAULT_WARM_TIMEOUT = 3600.0  # seconds `warm --wait` waits unless told (a script never hangs)
EXIT_TOO_LARGE = 3             # `warm`: the set is larger than the room for it
EXIT_TIMEOUT = 124             # `warm --wait`: --timeout passed (as timeout(1) says it)


def register(sub: argparse._SubParsersAction) -> None:
    warm = sub.add_parser(
        "warm", help="fill a spoke with a working set before the accelerators are billed",
        description="Ask a spoke to fetch files into its cache; it fetches them in the "
        "background, behind its readers. Without --wait the command returns once the spoke "
        "has accepted the warm-up (`--check` then says how far it got); with --wait it shows "
        "a progress bar (on a terminal) and returns when every byte is resident. A set larger "
        "than the cache (or than the dataset's share of it) is refused unless --force. "
        "URL is http://spoke:port/<dataset>[@<snapshot>][/<folder>].",
        epilog="Exit status: 0 done (or accepted, without --wait; all resident, with "
        "--check); 1 some files not resident once the warm-up ended (named: their blocks "
        "failed or were evicted; the spoke's log says why), or not all resident (--check); "
        f"2 an error; {EXIT_TOO_LARGE} the set is larger than the room for it (--force to "
        f"warm anyway); {EXIT_TIMEOUT} --timeout passed (the spoke goes on warming).")
    warm.add_argument("url", metavar="URL")
    g = warm.add_mutually_exclusive_group()
    g.add_argument("--paths", type=Path, metavar="FILE", help="file with one path per line")
    g.add_argument("--order", type=Path, metavar="FILE",
                   help="an announced-order file (one path per line, in reading order)")
    warm.add_argument("path", nargs="*", help="paths inside the dataset (default: all of URL)")
    warm.add_argument("--pin", action="store_true", help="keep these files resident")
    warm.add_argument("--wait", action="store_true",
                      help="follow the warm-up (a progress bar) until everything is resident")
    warm.add_argument("--timeout", type=parse_duration, default=DEFAULT_WARM_TIMEOUT,
                      help="with --wait: give up waiting after this long (default "
                      f"{DEFAULT_WARM_TIMEOUT / 3600:g}h; 0: wait for as long as it takes)")
    warm.add_argument("--force", action="store_true",
                      help="warm a set larger than the cache (or the dataset's share of it): "
                      "its first blocks are evicted to make room for the last")
    warm.add_argument("--check", action="store_true",
                      help="warm nothing: say how much of the set is resident, naming the "
                      "first files that are not; exit 0 only when all of it is")
    warm.set_defaults(func=_warm)

    status = sub.add_parser("status", help="show a hub's or spoke's state",
                            description="Cache use, hit ratio, upstream health, prefetch.")
    status.add_argument("url", metavar="URL", help="http://host:port")
    status.add_argument("--json", action="store_true", help="print raw JSON")
    status.set_defaults(func=_status)

    top = sub.add_parser("top", help="watch a spoke live: cache, link, prefetch, jobs",
                         description="A live view of a spoke, refreshed every --interval: "
                         "cache fill and hit ratio, the upstream link (RTT, delivery rate, "
                         "window, state), fetch queue, prefetch accuracy, evictions, errors, "
                         "per-dataset residency and warm-up, per-job working sets and (where "
                         "jobs report steps) data wait. Plain text: works over SSH. q quits.")
    top.add_argument("url", metavar="URL", help="http://spoke:port")
    top.add_argument("--interval", type=parse_duration, default=2.0,
                     help="time between refreshes (default 2s)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--json", action="store_true",
                     help="print one frame as JSON and exit (for scripts)")
    top.set_defaults(func=_top)

    purge = sub.add_parser("purge", help="drop cached blocks from a spoke",
                           description="Drop every cached block (of one dataset with URL "
                           "http://spoke:port/<dataset>[@SNAPSHOT]; of named files and "
                           "folders of it with PATH...). Needs an admin token where the "
                           "spoke asks for tokens.")
    purge.add_argument("url", metavar="URL")
    purge.add_argument("paths", nargs="*", metavar="PATH",
                       help="files or folders of the dataset (default: all of it)")
    purge.add_argument("--members", type=_url_list, metavar="URL,URL,...",
                       help="on a spoke tier, the other members to purge too (each holds its "
                       "share and copies of others' blocks); the admin token goes only to "
                       "URLs named here, never to a list a server gives")
    purge.add_argument("--this-member-only", action="store_true",
                       help="on a member of a spoke tier, purge it alone, and exit 0 although "
                       "other members hold blocks too")
    purge.set_defaults(func=_purge)

    inv = sub.add_parser("inventory", help="what a spoke holds, per dataset and snapshot",
                         description="Per dataset: resident blocks and bytes, least and most "
                         "recent use; per snapshot the spoke keeps: resident files and bytes. "
                         "Needs an admin token where the spoke asks for tokens.")
    inv.add_argument("url", metavar="URL", help="http://spoke:port")
    inv.add_argument("--json", action="store_true", help="print raw JSON")
    inv.add_argument("--tier", action="store_true",
                     help="every member's of a spoke tier, one after another, of the members "
                     "--members names (JSON: {\"members\": [{\"url\", \"inventory\" or "
                     "\"error\"}]})")
    inv.add_argument("--members", type=_url_list, metavar="URL,URL,...",
                     help="with --tier: the other members (the admin token goes only to URLs "
                     "named here, never to a list a server gives)")
    inv.set_defaults(func=_inventory)

    ls = sub.add_parser("ls", help="list a folder of a dataset snapshot")
    ls.add_argument("url", metavar="URL")
    ls.set_defaults(func=_ls)

    cat = sub.add_parser("cat", help="write a file of a dataset snapshot to stdout")
    cat.add_argument("url", metavar="URL")
    cat.set_defaults(func=_cat)


def _url_list(text: str) -> list[str]:
    from spokefs.tier.rendezvous import normalise_url

    return [normalise_url(u) for u in text.split(",") if u.strip()]


def _read_list(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _warm(args: argparse.Namespace) -> int:
    from spokefs.client.control import SpokeControl, WarmIncomplete, WarmTimedOut
    from spokefs.client.urls import parse_url

    u = parse_url(args.url)
    ctl = SpokeControl(args.url)
    paths = None
    if args.paths or args.order:
        paths = _read_list(args.paths or args.order)
    elif args.path:
        paths = [p.strip("/") for p in args.path]
    prefix = None if paths else u.path
    if args.check:
        r = ctl.residency(paths, prefix)
        print(_resident(r))
        if r["resident_bytes"] >= r["bytes"]:
            return 0
        print(_missing_line(ctl.missing(paths, prefix)), file=sys.stderr)
        return 1
    fit = ctl.fit(paths, prefix)
    if not fit.fits:
        assert fit.room is not None
        what = (f"the set is {format_size(fit.bytes)}, larger than {fit.limit} "
                f"({format_size(fit.room)}): warming it would evict its own first blocks")
        if not args.force:
            print(f"spokefs: warm refused: {what}; name fewer files, or say --force",
                  file=sys.stderr)
            return EXIT_TOO_LARGE
        print(f"spokefs: warning: {what} (--force)", file=sys.stderr)
    try:
        r = ctl.warm(paths=paths, prefix=prefix, pin=args.pin, wait=args.wait,
                     progress=None, timeout=args.timeout or None)
    except WarmTimedOut as exc:
        print(f"spokefs: {exc}; the spoke goes on warming (`spokefs warm --check` shows how "
              "far it got)", file=sys.stderr)
        return EXIT_TIMEOUT
    except WarmIncomplete as exc:
        print(_resident(exc.residency))
        print(f"spokefs: warm-up ended, {_missing_line(exc.missing)}; their blocks failed "
              "or were evicted again (the spoke's log says why)", file=sys.stderr)
        return 1
    if args.wait:
        print(_resident(r))
    else:
        print(f"warming {r['files']} files ({format_size(r['bytes'])}), "
              f"{r['blocks_to_fetch']} blocks to fetch; `spokefs warm --wait` to follow, "
              "`spokefs warm --check` to see how far it got")
    return 0


def _resident(r: dict[str, Any]) -> str:
    return (f"resident: {r['resident_files']}/{r['files']} files, "
            f"{format_size(r['resident_bytes'])} of {format_size(r['bytes'])}")


def _missing_line(missing: Missing) -> str:
    names = ", ".join(f"{p} ({format_size(n)} missing)" for p, n in missing.named)
    more = missing.files - len(missing.named)
    return (f"{missing.files} files not resident ({format_size(missing.bytes)}): {names}"
            + (f" and {more} more" if more > 0 else ""))


def _inventory(args: argparse.Namespace) -> int:
    from spokefs.client.sync import Client
    from spokefs.errors import ConfigError

    base = args.url.rstrip("/")
    client = Client(base)
    if not args.tier:
        doc = client.get_json("/v1/inventory")
        print(json.dumps(doc, indent=2) if args.json else _inventory_table(doc))
        return 0
    if not args.members and _tier_size(client) > 1:
        raise ConfigError("--tier needs --members URL,URL,...: the admin token goes only to "
                          "the URLs you name, never to the member list a server gives")
    urls = sorted(dict.fromkeys([base, *(args.members or [])]))
    members: list[dict[str, object]] = [
        {"url": url, "inventory": got} if err is None else {"url": url, "error": err}
        for url, got, err in _each_member(urls, lambda c: c.get_json("/v1/inventory"))]
    if args.json:
        print(json.dumps({"members": members}, indent=2))
    else:
        for m in members:
            inv = m.get("inventory")
            print(f"{m['url']}\n" + (_inventory_table(inv) if isinstance(inv, dict)
                                      else f"NOT LISTED: {m['error']}") + "\n")
    return 1 if any("error" in m for m in members) else 0


def _tier_size(client: Any) -> int:
    """How many members the spoke's tier has (1: a spoke on its own). Only a count: the URLs
    a server lists are never where a token is sent."""
    tier = client.get_json("/v1/status").get("tier")
    return len(tier["members"]) if tier else 1


def _each_member(urls: list[str], call: Callable[[Any], dict]
                 ) -> Iterator[tuple[str, dict | None, str | None]]:
    """``call`` on each member's client: (url, answer, None), or (url, None, the error) for a
    member that could not answer within 10 s (down: said soon, the others still asked)."""
    from spokefs.client.sync import Client
    from spokefs.errors import SpokeError, Transient

    for url in urls:
        try:
            yield url, call(Client(url, deadline=10.0)), None
        except (SpokeError, Transient) as exc:
            yield url, None, str(exc)


def _inventory_table(doc: dict) -> str:
    import time

    from spokefs.tables import table

    def ago(t: float | None) -> str:
        return "-" if t is None else f"{max(0, time.time() - t) / 3600:.1f} h ago"

    rows = []
    for d in doc["datasets"]:
        rows.append([d["dataset"], "(all)", "", format_size(d["bytes"]), d["blocks"],
                     ago(d["least_recent_use"]), ago(d["most_recent_use"])])
        for s in d["snapshots"]:
            if "error" in s:
                rows.append(["", s["snapshot"], s["error"][:60], "", "", "", ""])
                continue
            rows.append(["", s["snapshot"], f"{s['resident_files']}/{s['files']}",
                         f"{format_size(s['resident_bytes'])} of {format_size(s['bytes'])}",
                         "", "", ""])
    return (table(rows, ["dataset", "snapshot", "files", "bytes", "blocks", "least recent use",
                         "most recent use"]) if rows else "nothing cached")


def _status(args: argparse.Namespace) -> int:
    from spokefs.client.sync import Client

    base = args.url.rstrip("/")
    doc = Client(base, deadline=5).get_json("/v1/status")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['role']} at {base}")
    if doc["role"] == "hub":
        for d in doc["datasets"]:
            latest = d["latest"] or {}
            print(f"  {d['name']}: {d['snapshots']} snapshots, latest {latest.get('id')} "
                  f"({latest.get('files')} files, {format_size(latest.get('bytes') or 0)})")
        return 0
    c = doc["cache"]
    hr = doc["hit_ratio"]
    print(f"  upstream   {doc['upstream']}  "
          f"{'OK' if not doc['upstream_error'] else 'ERROR: ' + doc['upstream_error']}")
    print(f"  cache      {format_size(c['used_bytes'])} of {format_size(c['capacity_bytes'])} "
          f"in {c['blocks']} blocks, policy {c['policy']}"
          f"{'' if c['writable'] else ', NOT WRITABLE (passing through)'}")
    print(f"  reads      {int(doc['hits'])} hits, {int(doc['misses'])} misses"
          f"{'' if hr is None else f', hit ratio {hr:.3f}'}")
    print(f"  upstream   {doc['inflight']} requests in flight, {doc['queued']} queued")
    if doc.get("prefetch"):
        p = doc["prefetch"]
        print(f"  prefetch   {format_size(p.get('inflight_bytes', 0))} in flight, "
              f"{format_size(p.get('pinned_bytes', 0))} pinned")
    tier = doc.get("tier")
    if tier:
        err = tier.get("refresh_error")
        copies = (f", copies of others' blocks {format_size(tier.get('copy_bytes', 0))}"
                  if tier.get("copies") else ", no copies")
        print(f"  tier       {len(tier['members'])} members ({tier['source']}){copies}"
              f"{', LIST NOT REFRESHED: ' + err if err else ''}")
        for m in tier["members"]:
            print(f"    {m['url']:<40} {m['state']:<8} share {m.get('share', 0):.1%}"
                  f"{'  (this member)' if m.get('self') else ''}")
    return 0


def _top(args: argparse.Namespace) -> int:
    from spokefs.client.top import run

    return run(args.url, interval=args.interval, once=args.once, as_json=args.json)


def _purge(args: argparse.Namespace) -> int:
    from spokefs.client.sync import Client
    from spokefs.client.urls import parse_url
    from spokefs.errors import ConfigError
    from spokefs.tier.rendezvous import normalise_url

    if "/" in args.url.split("://", 1)[-1].strip("/"):
        u = parse_url(args.url)
        base, ds = u.base, u.dataset
    else:
        base, ds = args.url.rstrip("/"), None
    doc: dict[str, object] = {"dataset": ds}
    if args.paths:
        if ds is None:
            raise ConfigError("purging PATHs needs a dataset in the URL "
                              "(http://spoke:port/DATASET)")
        doc["paths"] = args.paths
        if u.snapshot not in (None, "latest"):
            doc["snapshot"] = u.snapshot
    client = Client(base)
    r = client.post_json("/v1/purge", doc)
    what = f"{r['files']} files" if args.paths else (ds or "everything")
    if args.this_member_only:
        print(f"freed {format_size(r['freed_bytes'])} ({what})")
        return 0
    others = [u for u in dict.fromkeys(args.members or []) if u != normalise_url(base)]
    if not others:
        size = _tier_size(client)
        print(f"freed {format_size(r['freed_bytes'])} ({what})")
        if size == 1:
            return 0
        # A tier: each member holds its share of the blocks, and copies of others'.
        print(f"this spoke is one of {size} tier members; the others keep their blocks: "
              "name them with --members URL,URL,... (the admin token goes only to URLs you "
              "name), or say --this-member-only", file=sys.stderr)
        return 1
    members = [base, *others]
    freed, failed = int(r["freed_bytes"]), []
    print(f"{base}: freed {format_size(r['freed_bytes'])}")
    for url, got, err in _each_member(others, lambda c: c.post_json("/v1/purge", doc)):
        if got is None:
            failed.append(url)
            print(f"{url}: NOT PURGED: {err}", file=sys.stderr)
            continue
        freed += int(got["freed_bytes"])
        print(f"{url}: freed {format_size(got['freed_bytes'])}")
    print(f"freed {format_size(freed)} ({what}) on {len(members) - len(failed)} of "
          f"{len(members)} tier members")
    if failed:
        print("the members not purged keep those blocks until purged again, or until "
              "--stale-after once the files change at the source", file=sys.stderr)
        return 1
    return 0


def _ls(args: argparse.Namespace) -> int:
    from spokefs.client.sync import Client
    from spokefs.client.urls import parse_url

    u = parse_url(args.url)
    e = Client(u.base).entry(u.dataset, u.snapshot, u.path)
    if e["type"] == "file":
        print(f"{e['size']:>12}  {e['path']}")
        return 0
    for d in e["dirs"]:
        print(f"{'-':>12}  {d}/")
    for f in e["files"]:
        print(f"{f['size']:>12}  {f['path'].rsplit('/', 1)[-1]}")
    return 0


def _cat(args: argparse.Namespace) -> int:
    import spokefs

    with spokefs.open(args.url) as f:
        while chunk := f.read(1 << 20):
            sys.stdout.buffer.write(chunk)
    return 0
