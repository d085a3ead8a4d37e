"""``spokefs bench ...``: benchmarks that write JSON (and plots) to --out; never part of tests.

Each benchmark lives in its own module exposing ``register(subparsers)``.
"""

from __future__ import annotations

import argparse

from spokefs.cli import register_modules

BENCH_MODULES = [
    "spokefs_bench.serve",
    "spokefs_bench.dataplane",
    "spokefs_bench.wan",
    "spokefs_bench.mount",
    "spokefs_bench.train",
    "spokefs_bench.policy",
    "spokefs_bench.race",
    "spokefs_bench.chaos",
    "spokefs_bench.abuse",
    "spokefs_bench.s3client",
    "spokefs_bench.tier",
    "spokefs_bench.native",
    "spokefs_bench.node",
    "spokefs_bench.contention",
    "spokefs_bench.checkpoint",
]


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure: serving, link, mount, training, policies",
                           description="Benchmarks. Each writes DIR/results.json (and plots "
                           "where they help) and prints a table. Run on an idle machine.")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bsub.required = True
    register_modules(bsub, BENCH_MODULES)
