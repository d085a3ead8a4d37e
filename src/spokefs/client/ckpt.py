"""``spokefs ckpt``: write files into a hub's writable dataset and publish them whole
(``client/uploads.py``; the hub's side is ``hub/uploads.py``, the guide docs/checkpoints.md).

URL is ``http://hub:8470/<dataset>/<folder>``; the token comes from ``SPOKEFS_TOKEN`` or
``SPOKEFS_TOKEN_FILE`` (a ``write:<dataset>`` or admin token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from spokefs.errors import ConfigError
from spokefs.units import parse_duration

if TYPE_CHECKING:
    from spokefs.client.uploads import Uploader


def register(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser(
        "ckpt", help="write checkpoints into a hub's writable dataset, published whole",
        description="Files go to the hub as resumable uploads, checked there against the "
        "digest of what was read here; a commit then publishes them together as one new "
        "snapshot, so no reader sees part of a checkpoint. Run again after a failure: only "
        "what the hub does not hold yet is sent.")
    cmds = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)

    push = cmds.add_parser(
        "push", help="upload a folder (or a file) and commit it",
        description="Upload every regular file under LOCAL as URL's folder/RELATIVE, then "
        "commit them as one snapshot (unless --no-commit). A progress bar on a terminal.",
        epilog="Exit status: 0 published (or uploaded, with --no-commit); 2 an error (the "
        "uploads that got through stay at the hub: run it again to send the rest).")
    push.add_argument("local", metavar="LOCAL", type=Path, help="a folder or a file")
    push.add_argument("url", metavar="URL", help="http://hub:port/<dataset>/<folder>")
    push.add_argument("--no-commit", action="store_true",
                      help="upload only; publish later with `spokefs ckpt commit URL`")
    push.set_defaults(func=_push)

    commit = cmds.add_parser(
        "commit", help="publish every whole upload under URL's folder as one snapshot",
        description="Publish the uploads under URL's folder together; refused (nothing "
        "published) when one is not whole yet or its path exists in the dataset.")
    commit.add_argument("url", metavar="URL", help="http://hub:port/<dataset>/<folder>")
    commit.set_defaults(func=_commit)

    uploads = cmds.add_parser("uploads", help="list the uploads not committed yet",
                              description="Each upload under way: path, bytes received of "
                              "its size, whether it is whole.")
    uploads.add_argument("url", metavar="URL", help="http://hub:port/<dataset>[/<folder>]")
    uploads.set_defaults(func=_uploads)

    status = cmds.add_parser(
        "status", help="what a spoke holds that is not yet safe at the hub",
        description="Through a spoke (write-back): each commit as local, uploading or waiting "
        "(bytes left), those the hub refused, and the last ones published; at a hub, its "
        "uploads not yet committed.")
    status.add_argument("url", metavar="URL", help="http://spoke:port/<dataset>[/<folder>]")
    status.set_defaults(func=_status)

    wait = cmds.add_parser(
        "wait", help="block until what was written under URL's folder is safe at the hub",
        description="Returns once no commit naming a file under the folder waits at the "
        "spoke: each is published at the hub.",
        epilog="Exit status: 0 safe; 1 the timeout passed; 2 the hub refused a commit (the "
        "reason is printed) or another error.")
    wait.add_argument("url", metavar="URL", help="http://spoke:port/<dataset>[/<folder>]")
    wait.add_argument("--timeout", type=parse_duration, default=3600.0, metavar="DURATION",
                      help="give up after this long (default 1h)")
    wait.set_defaults(func=_wait)


def _uploader(url: str) -> tuple[Uploader, str]:
    from spokefs.client.uploads import Uploader
    from spokefs.client.urls import parse_url

    u = parse_url(url)
    if u.snapshot != "latest":
        raise ConfigError(f"{url}: a write goes to the dataset, not to a snapshot "
                          f"(@{u.snapshot}): drop it")
    return Uploader(u.base, u.dataset), u.path


def _push(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from spokefs.client.uploads import tree_files

    up, folder = _uploader(args.url)
    if not args.local.exists():
        raise ConfigError(f"{args.local}: no such file or folder")
    files = tree_files(args.local, folder)
    if not files:
        raise ConfigError(f"{args.local}: no regular files to push")
    total = sum(p.stat().st_size for _, p in files)
    sent = 0
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              desc=f"push {len(files)} files", disable=None, leave=False) as bar:
        for path, local in files:
            done = up.put(path, local, progress=bar.update)
            sent += done.sent
            bar.update(done.size - done.sent)  # what the hub held already
    print(f"uploaded {len(files)} files, {total} bytes ({sent} sent now, "
          f"{total - sent} held by the hub already)")
    if args.no_commit:
        print(f"not published yet: spokefs ckpt commit {args.url}")
        return 0
    doc = up.commit(paths=[p for p, _ in files])
    _committed(doc, args.url, up.dataset)
    return 0


def _committed(doc: dict, url: str, dataset: str) -> None:
    if doc.get("safe") is False:  # a spoke's write-back: durable there, the hub's soon
        print(f"committed {len(doc['committed'])} files at the spoke; uploading them to the "
              f"hub (spokefs ckpt wait {url})")
    else:
        print(f"published {len(doc['committed'])} files as snapshot {doc['id']} of {dataset}")


def _commit(args: argparse.Namespace) -> int:
    up, folder = _uploader(args.url)
    if not folder:
        raise ConfigError(f"{args.url}: name the folder to commit "
                          "(http://hub:port/<dataset>/<folder>)")
    doc = up.commit(prefix=folder.rstrip("/") + "/")
    _committed(doc, args.url, up.dataset)
    return 0


def _uploads(args: argparse.Namespace) -> int:
    from spokefs.tables import table

    up, folder = _uploader(args.url)
    rows = [u for u in up.listing() if not folder or u["path"].startswith(folder + "/")]
    print(table([[u["path"], u["received"], u["size"], "yes" if u["whole"] else "no"]
                 for u in rows], ["path", "received", "size", "whole"]))
    return 0


def _status(args: argparse.Namespace) -> int:
    from spokefs.tables import table

    up, folder = _uploader(args.url)
    doc = up.writeback()
    under = folder.rstrip("/") + "/" if folder else ""
    if "commits" not in doc:  # a hub: its uploads only
        return _uploads(args)
    rows = [[c["commit"], c["files"], c["bytes"], c["state"]] for c in doc["commits"]
            if any(p.startswith(under) for p in c["paths"])]
    rows += [[c["commit"], len(c["paths"]), "", f"refused: {c['error']}"]
             for c in doc["failed"] if any(p.startswith(under) for p in c["paths"])]
    rows += [[c["commit"], c["files"], c["bytes"], f"safe ({c['snapshot'] or 'at the hub'})"]
             for c in doc["done"][-10:] if any(p.startswith(under) for p in c["paths"])]
    print(table(rows, ["commit", "files", "bytes", "state"]))
    print(f"{doc['unsafe_bytes']} bytes not yet safe at the hub"
          + (f"; last error: {doc['last_error']}" if doc.get("last_error") else ""))
    return 0


def _wait(args: argparse.Namespace) -> int:
    up, folder = _uploader(args.url)
    safe = up.wait_safe(folder.rstrip("/") + "/" if folder else "", args.timeout)
    if not safe:
        print(f"not yet safe at the hub after {args.timeout:g}s: spokefs ckpt status "
              f"{args.url}", file=sys.stderr)
        return 1
    print(f"safe at the hub: {args.url}")
    return 0
