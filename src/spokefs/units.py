"""Parse and format sizes ("64GiB", "400MB/s") and durations ("60ms", "2m")."""

from __future__ import annotations

import re

from spokefs.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0,
               "d": 86400.0}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: "4MiB" -> 4194304, "1.5GB" -> 1500000000, 123 -> 123."""
    if isinstance(text, int):
        return text
    m = _NUM.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (try 512MiB, 10GiB, 2TB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_rate(text: str | int) -> float:
    """Bytes per second in ``text``: "400MB/s", "1Gbit/s", "50MiB"."""
    if isinstance(text, int | float):
        return float(text)
    t = text.strip().lower().removesuffix("/s").removesuffix("ps")
    if t.endswith("bit"):
        return parse_size(t[:-3] or "1") / 8
    return float(parse_size(t))


def parse_duration(text: str | float) -> float:
    """Seconds in ``text``: "60ms" -> 0.06, "2m" -> 120, 1.5 -> 1.5."""
    if isinstance(text, int | float):
        return float(text)
    m = _NUM.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _TIME_UNITS:
        raise ConfigError(f"not a duration: {text!r} (try 60ms, 30s, 5m, 2h, 7d)")
    return float(m.group(1)) * _TIME_UNITS[unit]


def format_size(n: float) -> str:
    """Human-readable binary size: 4194304 -> "4.0 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
