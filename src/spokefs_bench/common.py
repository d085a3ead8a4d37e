"""Small helpers shared by the benchmarks: output folder, JSON, tables, percentiles,
tokens."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs.tables import table  # noqa: F401  (the benchmarks' import)
from spokefs.wire.auth import ENV_TOKEN


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def write_json(out: Path, doc: dict[str, Any], name: str = "results.json") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


@dataclass(frozen=True)
class BenchTokens:
    """Tokens for a benchmark's servers, as a deployment would have them: hub and spoke run
    with ``--auth`` (one file here), the spoke presents its own read token upstream, and the
    benchmark, its mounts and clients present an admin token (``SPOKEFS_TOKEN``)."""

    path: Path
    admin: str
    upstream_file: Path

    @classmethod
    def make(cls, folder: Path) -> BenchTokens:
        folder.mkdir(parents=True, exist_ok=True)
        admin, spoke = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        path, upstream = folder / "tokens", folder / "spoke-upstream-token"
        for p, text in ((path, f"bench admin {admin}\nspoke read {spoke}\n"),
                        (upstream, spoke + "\n")):
            p.write_text(text)
            p.chmod(0o600)
        return cls(path, admin, upstream)

    def hub_args(self) -> list[str]:
        return ["--auth", str(self.path)]

    def spoke_args(self) -> list[str]:
        return ["--auth", str(self.path), "--upstream-token-file", str(self.upstream_file)]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin}"}

    @contextlib.contextmanager
    def as_client(self) -> Iterator[None]:
        """Clients made meanwhile (here and in child processes) present the admin token."""
        before = os.environ.get(ENV_TOKEN)
        os.environ[ENV_TOKEN] = self.admin
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ENV_TOKEN, None)
            else:
                os.environ[ENV_TOKEN] = before


PLOTS_HINT = "install spokefs[bench] for plots (pip install 'spokefs[bench]')"


def have_matplotlib() -> bool:
    """Whether plots can be drawn (matplotlib, Agg backend); if not, say how to get them.
    The numbers (results.json, tables) are written either way."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plots; {PLOTS_HINT}", flush=True)
        return False
    matplotlib.use("Agg")
    return True


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]
