"""``spokefs hub serve`` and ``spokefs hub snapshot``."""

from __future__ import annotations

import argparse
import asyncio
import json

from spokefs.integrity import DEFAULT_BLOCK_SIZE
from spokefs.units import parse_size
from spokefs.wire.authargs import add_auth_arguments, tls_paths


def register(sub: argparse._SubParsersAction) -> None:
    hub = sub.add_parser("hub", help="publish a directory tree or a bucket as a dataset",
                         description="The hub: where a dataset lives, the source of truth.")
    hsub = hub.add_subparsers(dest="hub_command", metavar="ACTION")
    hsub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("dir", metavar="DIR", help="the dataset's folder, or s3://BUCKET/PREFIX "
                       "(docs/s3.md)")
        p.add_argument("--name", help="dataset name (default: the folder's name, or the "
                       "prefix's last part)")
        p.add_argument("--endpoint-url", help="an S3-compatible store's endpoint (default: "
                       "AWS_ENDPOINT_URL, else AWS)")
        p.add_argument("--state-dir", help="where snapshots and hashing work are kept "
                       "(default: ~/.local/state/spokefs/hub/NAME-HASH)")
        p.add_argument("--block-size", type=parse_size, default=DEFAULT_BLOCK_SIZE,
                       help="cache block size for a new dataset (default 4MiB)")

    serve = hsub.add_parser("serve", help="serve a dataset over HTTP",
                            description="Snapshot DIR (re-reading only changed files), then "
                            "serve it: the v1 API for spokes and mounts, plain paths for curl, "
                            "rclone and fsspec.")
    common(serve)
    serve.add_argument("--dataset", action="append", default=[], metavar="NAME=DIR",
                       help="serve the folder DIR as dataset NAME too (repeat for more; "
                       "each keeps its state in --state-dir/NAME, or its default)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8470, help="port (default 8470; 0 = any)")
    add_auth_arguments(serve)
    # A spoke on s3:// runs its private bucket hub on a socket it holds (a restarted hub
    # answers on the same address) and makes it die with the spoke (spoke/bucket.py).
    serve.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    snap = hsub.add_parser("snapshot", help="record a new snapshot of DIR",
                           description="Walk DIR, hash new and changed files, and list a new "
                           "snapshot if anything changed. Earlier snapshots stay listed.")
    common(snap)
    snap.add_argument("--hash", action="store_true", help="s3:// only: read every object now "
                      "and record its block digests (else they are made as blocks are read)")
    snap.set_defaults(func=_snapshot)


def _serve(args: argparse.Namespace) -> int:
    from spokefs.errors import ConfigError
    from spokefs.hub.backend import HubBackend, open_state
    from spokefs.wire.auth import check_bind
    from spokefs.wire.run import serve_forever
    from spokefs.wire.server import build_app

    if args.dir.startswith("s3://"):
        from spokefs.hub.bucket import serve_bucket

        if args.dataset:
            raise ConfigError("--dataset serves folders beside a folder; a bucket hub "
                              "serves one bucket prefix")
        return serve_bucket(args)
    if args.auth is not None:
        from spokefs.wire.auth import TokenFile

        TokenFile(args.auth)  # a bad token file stops the hub before it scans
    states = [open_state(args.dir, args.name, args.state_dir, args.block_size)]
    for spec in args.dataset:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--dataset {spec!r}: expected NAME=DIR")
        if name in {st.name for st in states}:
            raise ConfigError(f"--dataset {spec!r}: a second dataset named {name!r}")
        states.append(open_state(folder, name, f"{args.state_dir}/{name}" if args.state_dir
                                 else None, args.block_size))
    try:
        for state in states:
            result = state.scan(show_progress=True)
            s = result.snapshot
            print(f"dataset {state.name}: snapshot {s.id} ({s.files} files, {s.bytes} bytes"
                  f"{', new' if result.created_new else ''})", flush=True)
        check_bind(args.host, args.auth, args.insecure, "hub")
        tls = tls_paths(args)
        from spokefs.audit import Audit

        app = build_app(HubBackend(states), auth=args.auth, audit=Audit(args.audit_log))
        asyncio.run(serve_forever(app, args.host, args.port, "hub", tls=tls))
    finally:
        for state in states:
            state.close()
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    from spokefs.hub.backend import open_state

    if args.dir.startswith("s3://"):
        from spokefs.hub.bucket import snapshot_bucket

        return snapshot_bucket(args)
    state = open_state(args.dir, args.name, args.state_dir, args.block_size)
    try:
        result = state.scan(show_progress=True)
    finally:
        state.close()
    print(json.dumps({"dataset": state.name, "new": result.created_new,
                      "files_hashed": result.files_hashed, **result.snapshot.to_json()}))
    return 0
