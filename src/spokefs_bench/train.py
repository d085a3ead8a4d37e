"""``spokefs bench train`` and ``spokefs bench seed``: the training benchmark.

The work lives in ``spokefs_bench.training``; this module only parses arguments.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from spokefs.units import parse_duration, parse_rate, parse_size
from spokefs.wan.cli import _arg
from spokefs_bench.common import Figure, add_allow_missing_peers, add_repeat

TRAIN_DOC = """\
Train with a real PyTorch DataLoader (workers > 0) on a synthetic dataset, the accelerator
emulated MLPerf-Storage style (a fixed sleep per batch, or --model for a tiny CNN on the CPU,
or --model resnet50 --device cuda for a real model on a GPU), once per scenario on the same
data and loop:

  local               the hub on this host, no link (ranged GETs to the hub)
  remote_direct       over the emulated link to the hub, one ranged GET per sample, no cache
  remote_spoke        through a cold spoke behind the link, read through `spokefs mount`
  remote_spoke_hints  the same, the sampler announcing its order (needs spokefs.torch)
  staged              copy everything over the link first (parallel ranges), then train
  rclone              rclone mount :http: --vfs-cache-mode full over the link (if installed)
  fsspec_cache        fsspec simplecache::http over the link

Append @narrow (or @wide) to a remote scenario to pick its link. Every sample is checked
against its source digest. Writes DIR/results.json, DIR/timeline.csv, DIR/timeline.png and
DIR/summary.png, and prints a table. Definitions: docs/benchmark.md.
"""


ARCHS = ("tiny", "resnet50")  # training.loop.ARCH_SHAPES, without importing torch here


def _csv(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="training loop over local, remote, spoke, staged, peers",
                       description=TRAIN_DOC,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--shape", default="files", choices=["files", "shards", "both"],
                   help="dataset shape: many small files in class folders, WebDataset-style "
                   "tar shards, or both (default: files)")
    p.add_argument("--scenarios", type=_csv, metavar="A,B,...",
                   help="scenarios to run, NAME or NAME@LINK (default: all)")
    p.add_argument("--samples", type=int, default=800, help="samples (default 800)")
    p.add_argument("--sample-size", type=_arg(parse_size), default=100_000, metavar="SIZE",
                   help="mean sample size, uniform within +-25%% (default 100KB)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default 10)")
    p.add_argument("--shard-size", type=_arg(parse_size), default=64 << 20, metavar="SIZE",
                   help="target shard size for --shape shards (default 64MiB)")
    p.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch (default 16)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    p.add_argument("--compute", type=_arg(parse_duration), default=0.1, metavar="DURATION",
                   help="emulated accelerator time per batch (default 100ms: with the "
                   "defaults 160 samples/s, 16 MB/s)")
    p.add_argument("--model", nargs="?", const="tiny", default=None, choices=ARCHS,
                   metavar="NAME",
                   help="a real training step instead of the sleep: alone, a tiny CNN on the "
                   "CPU; resnet50: torchvision's ResNet-50 (random weights, each sample's "
                   "bytes cropped or padded to a 3x224x224 image, bf16 on CUDA; needs "
                   "torchvision)")
    p.add_argument("--device", default="cpu",
                   help="where --model resnet50 trains: cpu, cuda, cuda:N (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="data and shuffle seed (default 0)")
    p.add_argument("--rtt", type=_arg(parse_duration), default=0.06, metavar="DURATION",
                   help="link round trip (default 60ms)")
    p.add_argument("--bandwidth", type=_arg(parse_rate), default=400e6, metavar="RATE",
                   help="the wide link's cap, above the loop's demand (default 400MB/s)")
    p.add_argument("--link", choices=["wide", "narrow"], default="wide",
                   help="link for remote scenarios named without @LINK (default wide)")
    p.add_argument("--narrow-bandwidth", type=_arg(parse_rate), metavar="RATE",
                   help="the narrow link's cap (default: half the loop's nominal demand)")
    p.add_argument("--cache-size", type=_arg(parse_size), metavar="SIZE",
                   help="spoke cache size (default: twice the dataset)")
    p.add_argument("--spoke-reader", choices=["auto", "mount", "http"], default="auto",
                   help="how remote_spoke reads: spokefs mount, HTTP to the spoke, or the "
                   "mount when it works here (default auto)")
    p.add_argument("--stage-inflight", type=int, default=64,
                   help="ranged GETs in flight for the staged copy (default 64)")
    p.add_argument("--price-per-gb", type=float, default=0.02,
                   help="$ per GB over the link (default 0.02)")
    p.add_argument("--gpu-hour-price", type=float, default=2.0,
                   help="$ per accelerator hour, charged for idle time (default 2.0)")
    p.add_argument("--data-dir", type=Path,
                   help="where built datasets are kept for reuse (default: "
                   "$TMPDIR/spokefs-bench-train)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--origin", choices=("dir", "s3"), default="dir",
                   help="what the hub serves: dir (the dataset's folder) or s3 (a bucket of "
                   "a local S3 server, moto; docs/s3.md)")
    add_allow_missing_peers(p)
    p.set_defaults(func=_train)
    add_repeat(p, _headlines)

    s = sub.add_parser("seed", help="the reference experiment at small scale (a few minutes)",
                       description="The reference experiment, small: 800 files of ~100 KB in "
                       "class folders, a 60 ms link, 3 epochs, every scenario plus "
                       "remote_spoke on a narrow link (about 4 minutes on 2 cores). --quick: "
                       "320 files, no local_http (about 2 minutes).")
    s.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    s.add_argument("--quick", action="store_true", help="the small version (320 files)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--origin", choices=("dir", "s3"), default="dir",
                   help="what the hub serves: dir (the dataset's folder; the default) or s3 "
                   "(the dataset put in a bucket of a local S3 server, moto, and a hub over "
                   "the bucket, behind the same link)")
    add_allow_missing_peers(s)
    s.set_defaults(func=_seed)
    add_repeat(s, _headlines)


def _headlines(doc: dict[str, Any]) -> dict[str, Figure]:
    from spokefs_bench.training.run import headlines

    return headlines(doc)


def _train(args: argparse.Namespace) -> int:
    from spokefs_bench.training.loop import LoopConfig
    from spokefs_bench.training.run import ALL_SCENARIOS, TrainConfig, run_train

    cfg = TrainConfig(
        out=args.out, shapes=("files", "shards") if args.shape == "both" else (args.shape,),
        scenarios=args.scenarios or ALL_SCENARIOS, samples=args.samples,
        sample_size=args.sample_size, classes=args.classes, shard_size=args.shard_size,
        loop=LoopConfig(epochs=args.epochs, batch_size=args.batch_size, workers=args.workers,
                        compute_s=args.compute, model=args.model is not None, seed=args.seed,
                        arch=args.model or "tiny", device=args.device),
        rtt=args.rtt, bandwidth=args.bandwidth, narrow_bandwidth=args.narrow_bandwidth,
        link=args.link, cache_size=args.cache_size, spoke_reader=args.spoke_reader,
        stage_inflight=args.stage_inflight, price_per_gb=args.price_per_gb,
        gpu_hour_price=args.gpu_hour_price, data_dir=args.data_dir,
        progress=not args.no_progress, origin=args.origin,
        allow_missing_peers=args.allow_missing_peers)
    run_train(cfg)
    return 0


def _seed(args: argparse.Namespace) -> int:
    from spokefs_bench.training.run import run_seed

    run_seed(args.out, quick=args.quick, progress=not args.no_progress, origin=args.origin,
             allow_missing_peers=args.allow_missing_peers)
    return 0
