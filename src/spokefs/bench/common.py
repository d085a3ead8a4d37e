"""Small helpers shared by the benchmarks: output folder, JSON, tables, percentiles."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from spokefs.tables import table  # noqa: F401  (the benchmarks' import)


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def write_json(out: Path, doc: dict[str, Any], name: str = "results.json") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]
