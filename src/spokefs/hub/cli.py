"""``spokefs hub serve`` and ``spokefs hub snapshot``."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from spokefs.integrity import DEFAULT_BLOCK_SIZE
from spokefs.units import parse_size
from spokefs.wire.authargs import add_auth_arguments, tls_paths


def register(sub: argparse._SubParsersAction) -> None:
    hub = sub.add_parser("hub", help="publish folders and buckets as datasets",
                         description="The hub: where a dataset lives, the source of truth.")
    hsub = hub.add_subparsers(dest="hub_command", metavar="ACTION")
    hsub.required = True

    def common(p: argparse.ArgumentParser, optional: bool = False) -> None:
        p.add_argument("dir", metavar="DIR", nargs="?" if optional else None,
                       help="the dataset's folder, or s3://, gs://, az:// BUCKET/PREFIX "
                       "(docs/s3.md)")
        p.add_argument("--name", help="dataset name (default: the folder's name, or the "
                       "prefix's last part)")
        p.add_argument("--endpoint-url", help="an object store's endpoint (default: "
                       "AWS_ENDPOINT_URL for s3://, STORAGE_EMULATOR_HOST for gs://, else the "
                       "cloud's own)")
        p.add_argument("--state-dir", help="where snapshots and hashing work are kept "
                       "(default: ~/.local/state/spokefs/hub/NAME-HASH)")
        p.add_argument("--block-size", type=parse_size, default=DEFAULT_BLOCK_SIZE,
                       help="cache block size for a new dataset (default 4MiB)")

    serve = hsub.add_parser("serve", help="serve datasets over HTTP",
                            description="Snapshot DIR (re-reading only changed files), then "
                            "serve it: the v1 API for spokes and mounts, plain paths for curl, "
                            "rclone and fsspec. More datasets: --dataset, and [datasets.NAME] "
                            "tables of the --config file, re-read on SIGHUP and when it "
                            "changes (docs/operations.md).")
    common(serve, optional=True)
    serve.add_argument("--dataset", action="append", default=[], metavar="NAME=SOURCE",
                       help="serve SOURCE (a folder, or s3://, gs://, az:// BUCKET/PREFIX) as "
                       "dataset NAME too (repeat for more; each keeps its state in "
                       "--state-dir/NAME, or its default)")
    serve.add_argument("--writable", action="append", default=[], metavar="NAME",
                       help="dataset NAME (DIR's or a --dataset's; a folder) takes uploads and "
                       "commits from write:NAME tokens (docs/checkpoints.md); in --config: "
                       "writable = true")
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
    import socket

    from spokefs.audit import Audit
    from spokefs.errors import ConfigError
    from spokefs.hub import namespace as ns
    from spokefs.hub.backend import HubBackend
    from spokefs.hub.routes import HubRoutes
    from spokefs.wire.auth import check_bind
    from spokefs.wire.paths import check_dataset_name
    from spokefs.wire.routetable import Owner
    from spokefs.wire.run import serve_forever
    from spokefs.wire.server import RELOAD_KEY, build_app

    if args.die_with_parent:
        from spokefs.procs import die_with_parent

        die_with_parent()
    if args.auth is not None:
        from spokefs.wire.auth import TokenFile

        TokenFile(args.auth)  # a bad token file stops the hub before it scans
    fixed = []
    if args.dir is not None:
        from spokefs.origin.base import is_store_url, parse_store_url

        if is_store_url(args.dir):
            source, default = args.dir, parse_store_url(args.dir).default_name
        else:
            source = str(Path(args.dir).resolve())
            default = Path(source).name
        fixed.append(ns.DatasetSpec(check_dataset_name(args.name or default), source,
                                    args.block_size, args.state_dir, args.endpoint_url,
                                    args.dir))
    fixed += [ns.from_flag(spec, args.block_size, args.state_dir, args.endpoint_url)
              for spec in args.dataset]
    fixed = _writable(fixed, args.writable)
    resolved = getattr(args, "_config", None)
    file: Path | None = resolved.config_file if resolved is not None else None
    if not fixed and file is None:
        raise ConfigError("nothing to serve: give DIR, --dataset NAME=SOURCE, or a --config "
                          "file with [datasets.NAME] tables")

    def report(st: object, result: object) -> None:
        s = result.snapshot  # type: ignore[attr-defined]
        print(f"dataset {st.name}: snapshot {s.id} ({s.files} files, {s.bytes} bytes"  # type: ignore[attr-defined]
              f"{', new' if result.created_new else ''}) from {st.root}",  # type: ignore[attr-defined]
              flush=True)

    backend = HubBackend([])
    space = ns.Namespace(backend, fixed, file, (args.block_size, args.state_dir,
                                                args.endpoint_url), report)
    opened = space.initial()
    try:
        for st, result in opened:
            backend.add(st)
            report(st, result)
        check_bind(args.host, args.auth, args.insecure, "hub")
        app = build_app(backend, {Owner.WRITES: HubRoutes(backend)}, auth=args.auth,
                        audit=Audit(args.audit_log))
        app[RELOAD_KEY] = [space.request_reload]

        async def lifecycle(app: object) -> AsyncIterator[None]:
            watcher = (asyncio.create_task(space.watch(), name="hub-namespace-watch")
                       if file is not None else None)
            yield
            if watcher is not None:
                watcher.cancel()
            await backend.close()  # digests made from bucket reads written before exit

        app.cleanup_ctx.append(lifecycle)
        fd = args.listen_fd
        sock = None if fd is None else socket.socket(fileno=fd)
        asyncio.run(serve_forever(app, args.host, args.port, "hub", sock=sock,
                                  tls=tls_paths(args)))
    finally:
        for state in list(backend.states.values()):
            state.close()
    return 0


def _writable(fixed: list, names: list[str]) -> list:
    """``fixed`` with the datasets ``--writable`` names made writable."""
    import dataclasses

    from spokefs.errors import ConfigError
    from spokefs.origin.base import is_store_url

    by_name = {s.name: s for s in fixed}
    for name in names:
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(f"--writable {name}: no dataset {name!r} given by DIR or --dataset "
                              "(in a --config file: writable = true in its table)")
        if is_store_url(spec.source):
            raise ConfigError(f"--writable {name}: writable datasets are folders; "
                              f"{spec.source} is an object store")
        by_name[name] = dataclasses.replace(spec, writable=True)
    return [by_name[s.name] for s in fixed]


def _snapshot(args: argparse.Namespace) -> int:
    from spokefs.hub.backend import open_state
    from spokefs.origin.base import is_store_url

    if is_store_url(args.dir):
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
