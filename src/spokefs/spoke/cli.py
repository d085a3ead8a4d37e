"""``spokefs spoke serve``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from spokefs.errors import ConfigError
from spokefs.units import parse_duration, parse_size
from spokefs.wire.authargs import add_auth_arguments, tls_paths


def register(sub: argparse._SubParsersAction) -> None:
    spoke = sub.add_parser("spoke", help="run a cache service near the compute",
                           description="The spoke: a read-through block cache on local disk "
                           "in front of a hub (or another spoke), or straight on a bucket "
                           "(s3://, through a private hub it runs; docs/s3.md).")
    ssub = spoke.add_subparsers(dest="spoke_command", metavar="ACTION")
    ssub.required = True
    serve = ssub.add_parser(
        "serve", help="serve the upstream's datasets through a local cache",
        description="Serve the same API as the hub. Hits come from local disk; misses are "
        "fetched from the upstream in batch reads, many in flight, verified, served and "
        "kept. The cache survives restarts and never exceeds --cache-size.")
    serve.add_argument("--upstream", required=True, action="append", metavar="[PATTERNS=]URL",
                       help="hub or spoke to read from, e.g. http://hub.example:8470, or a "
                       "bucket, s3://BUCKET/PREFIX (docs/s3.md). Repeat for several: a "
                       "dataset is served by the first one whose PATTERNS (comma-separated, "
                       "* ? [..] wildcards) match its name, e.g. 'scratch-*=https://hub-us:8470'; "
                       "one without PATTERNS serves every name (docs/operations.md, "
                       "\"Several upstreams\")")
    serve.add_argument("--name", help="s3:// only: the dataset's name (default: the "
                       "prefix's last part)")
    serve.add_argument("--endpoint-url", help="s3:// only: an S3-compatible store's endpoint "
                       "(default: AWS_ENDPOINT_URL, else AWS)")
    serve.add_argument("--block-size", type=parse_size, default=None,
                       help="s3:// only: cache block size for a new dataset (default 4MiB)")
    serve.add_argument("--cache-dir", required=True, type=Path, help="local cache folder")
    serve.add_argument("--cache-size", required=True, type=parse_size,
                       help="hard bound on cached bytes, e.g. 200GiB")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8471, help="port (default 8471; 0 = any)")
    serve.add_argument("--policy", default="belady",
                       help="eviction policy: belady (evicts the block needed farthest ahead "
                       "in announced orders; LRU without them; the default), lru, s3fifo")
    serve.add_argument("--deadline", type=parse_duration, default=30.0,
                       help="fail an uncached read after the upstream has been unreachable "
                       "this long (default 30s)")
    serve.add_argument("--max-inflight", type=int, default=64,
                       help="upstream requests in flight (default 64)")
    serve.add_argument("--no-fsync", action="store_true",
                       help="skip fsync of cached blocks (faster; a power loss may drop "
                       "blocks, never serve bad ones)")
    serve.add_argument("--latest-ttl", type=parse_duration, default=10.0,
                       help="how long the upstream's latest snapshot is trusted (default 10s)")
    serve.add_argument("--no-prefetch", action="store_true",
                       help="only fetch what readers ask for (no readahead, no learning)")
    serve.add_argument("--prefetch-inflight", type=parse_size, default=256 << 20,
                       help="most prefetch bytes in flight (default 256MiB); within it the "
                       "spoke keeps about twice the link's measured bandwidth x round trip")
    serve.add_argument("--no-pacing", action="store_true",
                       help="let prefetch use all of --prefetch-inflight and --max-inflight "
                       "instead of what the link measurably needs (readers then wait behind "
                       "prefetch on a narrow link)")
    serve.add_argument("--write-io", choices=("auto", "direct", "buffered"), default="auto",
                       help="how fetched blocks are written: direct (past the page cache; "
                       "for caches larger than memory), buffered (through it: a block read "
                       "soon after is a memory read), auto (direct when --cache-size is over "
                       "half the memory; the default)")
    serve.add_argument("--read-window", type=parse_size, default=64 << 20, metavar="SIZE",
                       help="how far one read of a large range fetches ahead of what its "
                       "client has taken (default 64MiB): a slow or abandoned reader holds "
                       "and pulls no more than this")
    add_auth_arguments(serve)
    serve.add_argument("--upstream-token-file", type=Path, action="append", metavar="FILE",
                       help="this spoke's own token for its upstream (its first line); a "
                       "spoke never forwards a client's token. With several --upstream, one "
                       "per upstream in the same order")
    serve.add_argument("--dataset-config", type=Path, metavar="FILE",
                       help="per-dataset rules (TOML): cache = \"deny\", ttl, max_share, min_share "
                       "(a reserved share), idle_after; re-read when it changes and on SIGHUP "
                       "(docs/security.md)")
    serve.add_argument("--pin-ttl", type=parse_duration, default=24 * 3600.0,
                       metavar="DURATION", help="how long a warm-up's pins hold (default "
                       "24h; warm again to renew); warm-ups may pin at most 80%% of the cache")
    serve.add_argument("--stale-after", type=parse_duration, default=600.0,
                       metavar="DURATION", help="a file changed or removed at the source "
                       "leaves the cache within this long once no snapshot in use holds it "
                       "(default 10m; 0: kept until evicted; docs/security.md)")
    serve.add_argument("--unsafe-quota", type=parse_size, default=64 << 30, metavar="SIZE",
                       help="bytes written through this spoke into a writable dataset and not "
                       "yet published at the hub, at most (default 64GiB): past it, new "
                       "uploads answer 507 until the hub has taken some (docs/checkpoints.md)")
    serve.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                       help="commits written through this spoke are put in its cache once the "
                       "hub publishes them, and the last N of each dataset stay pinned, at "
                       "most half the cache (default 2; 0: not cached at publish; "
                       "docs/checkpoints.md)")
    serve.add_argument("--workers", type=int, default=None, metavar="N",
                       help="processes serving readers (default: the number of cores, at "
                       "most 16): one primary fills the cache, the others serve from it too")
    from spokefs.spoke.tierargs import add_tier_arguments

    add_tier_arguments(serve)
    serve.set_defaults(func=_serve)
    worker = ssub.add_parser("_worker", help=argparse.SUPPRESS)
    worker.add_argument("--role", choices=("primary", "replica"), required=True)
    worker.add_argument("--index", type=int, required=True)
    worker.add_argument("--listen-fd", type=int, required=True)
    worker.add_argument("--unix", required=True)
    worker.add_argument("--config", required=True)
    worker.set_defaults(func=_worker)


def _serve(args: argparse.Namespace) -> int:
    from spokefs.spoke.upstreams import Routes, parse_upstream, with_tokens

    if args.keep_checkpoints < 0:
        raise ConfigError(f"--keep-checkpoints {args.keep_checkpoints}: give a count of "
                          "commits, 0 or more")
    tokens = [str(p) for p in args.upstream_token_file or ()]
    specs = with_tokens([parse_upstream(u) for u in args.upstream], tokens)
    Routes(specs)  # two upstreams of one URL, an s3:// one beside others: refused here
    if specs[0].url.startswith("s3://"):  # a private bucket hub becomes the upstream
        from spokefs.spoke.bucket import serve_on_bucket

        if specs[0].datasets:
            raise ConfigError("an s3:// upstream serves its one bucket prefix; it takes no "
                              "dataset patterns (name it with --name)")
        return serve_on_bucket(args, _serve)
    for opt in ("name", "endpoint_url", "block_size"):
        if getattr(args, opt) is not None:
            raise ConfigError(f"--{opt.replace('_', '-')} is for an s3:// upstream: a hub "
                              "names its datasets and sets their block size")
    from spokefs.spoke.app import run_spoke
    from spokefs.spoke.service import SpokeConfig

    config = SpokeConfig(upstream=specs[0].url, cache_dir=args.cache_dir,
                         cache_size=args.cache_size, policy=args.policy, deadline=args.deadline,
                         max_inflight=args.max_inflight, fsync=not args.no_fsync,
                         latest_ttl=args.latest_ttl, prefetch=not args.no_prefetch,
                         prefetch_inflight=args.prefetch_inflight,
                         pacing=not args.no_pacing, write_io=args.write_io,
                         read_window=args.read_window, pin_ttl=args.pin_ttl,
                         stale_after=args.stale_after, unsafe_quota=args.unsafe_quota,
                         keep_checkpoints=args.keep_checkpoints,
                         auth=str(args.auth) if args.auth else None,
                         audit_log=args.audit_log,
                         upstream_token_file=specs[0].token_file,
                         upstreams=([dataclasses.asdict(sp) for sp in specs]
                                    if len(specs) > 1 or specs[0].datasets else []))
    if args.dataset_config is not None:
        from spokefs.spoke.datasets import DatasetConfig

        DatasetConfig(args.dataset_config)  # a bad file stops the spoke before it starts
        config.dataset_config = str(args.dataset_config.absolute())
    tls = tls_paths(args)
    if tls is not None:
        from spokefs.wire.tls import server_context

        server_context(*tls)  # a bad certificate stops the spoke before it starts
        config.tls_cert, config.tls_key = str(tls[0]), str(tls[1])
    from spokefs.spoke.tierargs import tier_config

    for field, value in tier_config(args, args.host, args.port, tls is not None).items():
        setattr(config, field, value)
    config.tier_token()  # an unreadable tier token file stops the spoke before it starts
    if config.tiered() and args.auth is not None and config.tier_token_file is None:
        raise ConfigError("a tier whose members ask for tokens (--auth) needs "
                          "--tier-token-file: the tier's own token, a line 'NAME tier TOKEN' "
                          "in every member's --auth file (never the hub's token)")
    from spokefs.wire.auth import TokenFile, check_bind

    check_bind(args.host, args.auth, args.insecure, "spoke")
    if args.auth is not None:
        TokenFile(args.auth)  # a bad token file stops the spoke before it starts
    config.upstream_tokens()  # and so does an unreadable upstream token file
    from spokefs.spoke.workers import default_workers, serve_workers

    workers = default_workers() if args.workers is None else args.workers
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, not {workers}")
    if workers > 1:
        return serve_workers(config, args.host, args.port, workers)
    asyncio.run(run_spoke(config, args.host, args.port))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from spokefs.spoke.workers import run_worker

    return run_worker(args.role, args.index, args.listen_fd, args.unix, args.config)
