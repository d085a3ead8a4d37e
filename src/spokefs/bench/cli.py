"""``spokefs bench ...``: benchmarks that write JSON (and plots) to --out; never part of tests.

Each benchmark lives in its own module exposing ``register(subparsers)``.
"""

from __future__ import annotations

import argparse

from spokefs.cli import register_modules

BENCH_MODULES = [
    "spokefs.bench.serve",
    "spokefs.bench.dataplane",
    "spokefs.bench.wan",
    "spokefs.bench.mount",
    "spokefs.bench.train",
    "spokefs.bench.policy",
    "spokefs.bench.race",
    "spokefs.bench.chaos",
    "spokefs.bench.abuse",
    "spokefs.bench.s3client",
    "spokefs.bench.tier",
]


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure: serving, link, mount, training, policies",
                           description="Benchmarks. Each writes DIR/results.json (and plots "
                           "where they help) and prints a table. Run on an idle machine.")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bsub.required = True
    register_modules(bsub, BENCH_MODULES)
