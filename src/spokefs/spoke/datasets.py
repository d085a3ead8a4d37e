"""Per-dataset residency and retention, set on the spoke (``--dataset-config FILE``).

A TOML file; a table per dataset, and an optional ``default`` for the others::

    [default]
    ttl = "30d"

    [datasets.patients]
    cache = "deny"        # bytes pass through; nothing is kept on this host

    [datasets.imagenet]
    ttl = "24h"           # a cached block is never served past this age, and is dropped
    max_share = 0.5       # at most this share of the cache; past it, blocks pass through
    min_share = 0.3       # reserved: never evicted for other datasets' blocks while in use
    idle_after = "10m"    # in use while read within this long (default 10m)

The reserved shares (``min_share``, per dataset, not in [default]) add up to at most 1 and
each is at most its dataset's ``max_share``; eviction takes from whoever is over their
reserved share first (``spokefs.policy.shares``, installed by ``spokefs.spoke.fairshare``).

Read at start (a bad file stops the spoke), then again when it changes (checked every few
seconds) and on SIGHUP; a bad edit keeps the rules in force and says why in the log.
Sans-I/O apart from reading the file.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spokefs.errors import ConfigError
from spokefs.filestamp import Stamp, file_stamp, stamp_of
from spokefs.policy.shares import IDLE_S
from spokefs.units import parse_duration

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetRules:
    cache: bool = True               # False: served, never kept
    ttl: float | None = None         # seconds a cached block may be served
    max_share: float | None = None   # of the cache's capacity
    min_share: float | None = None   # reserved, of the cache's capacity, while in use
    idle_after: float = IDLE_S       # seconds without a read before a reservation lapses


ALLOW_ALL = DatasetRules()
KEYS = ("cache", "ttl", "max_share", "min_share", "idle_after")


def parse_rules(text: str, where: str = "dataset config") -> tuple[DatasetRules,
                                                                   dict[str, DatasetRules]]:
    """(the default rules, rules per dataset). ConfigError naming what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not TOML: {exc}") from exc
    unknown = set(doc) - {"default", "datasets"}
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {sorted(unknown)}; use [default] and "
                          "[datasets.NAME]")
    default = _rules(doc.get("default", {}), f"{where} [default]")
    if default.min_share is not None:
        raise ConfigError(f"{where} [default]: min_share is reserved per dataset; set it in "
                          "[datasets.NAME]")
    per = doc.get("datasets", {})
    if not isinstance(per, dict):
        raise ConfigError(f"{where}: 'datasets' must be tables [datasets.NAME]")
    rules = {str(name): _rules(t, f"{where} [datasets.{name}]")
             for name, t in per.items()}
    reserved = {name: r.min_share for name, r in rules.items() if r.min_share}
    if sum(reserved.values()) > 1 + 1e-9:
        tables = ", ".join(f"[datasets.{n}] {v:g}" for n, v in sorted(reserved.items()))
        raise ConfigError(f"{where}: min_share adds up to {sum(reserved.values()):g} ({tables}); "
                          "the reserved shares must add up to at most 1 (the whole cache)")
    return default, rules


def _share(table: dict[str, Any], key: str, where: str) -> float | None:
    share = table.get(key)
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                              or not 0 < share <= 1):
        raise ConfigError(f"{where}: {key} must be a number in (0, 1], not {share!r}")
    return float(share) if share is not None else None


def _rules(table: Any, where: str) -> DatasetRules:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = set(table) - set(KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} ({', '.join(KEYS)})")
    cache = table.get("cache", "allow")
    if cache not in ("allow", "deny"):
        raise ConfigError(f"{where}: cache must be \"allow\" or \"deny\", not {cache!r}")
    ttl = table.get("ttl")
    if ttl is not None:
        ttl = parse_duration(str(ttl))
        if ttl <= 0:
            raise ConfigError(f"{where}: ttl must be > 0")
    max_share = _share(table, "max_share", where)
    min_share = _share(table, "min_share", where)
    idle = table.get("idle_after")
    if idle is not None:
        idle = parse_duration(str(idle))
        if idle <= 0:
            raise ConfigError(f"{where}: idle_after must be > 0")
    if min_share is not None:
        if max_share is not None and min_share > max_share:
            raise ConfigError(f"{where}: min_share {min_share:g} is above max_share "
                              f"{max_share:g}: a reservation cannot exceed its ceiling")
        if cache == "deny":
            raise ConfigError(f"{where}: min_share with cache = \"deny\": nothing is kept")
    return DatasetRules(cache == "allow", ttl, max_share, min_share,
                        idle if idle is not None else IDLE_S)


class DatasetConfig:
    """The rules in force, from a file (or none: everything allowed, kept, no limit)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.default = ALLOW_ALL
        self.rules: dict[str, DatasetRules] = {}
        self._stamp: Stamp | None = None
        self.on_change: list[Callable[[], None]] = []  # told after the rules changed
        if path is not None:
            self.reload(strict=True)

    def get(self, dataset: str) -> DatasetRules:
        return self.rules.get(dataset, self.default)

    @property
    def any_ttl_or_deny(self) -> bool:
        return any(r.ttl is not None or not r.cache
                   for r in (self.default, *self.rules.values()))

    def reload(self, strict: bool = False) -> bool:
        """Read the file again; whether the rules changed."""
        if self.path is None:
            return False
        try:
            st = os.stat(self.path)
            default, rules = parse_rules(self.path.read_text(), str(self.path))
        except (OSError, ConfigError) as exc:
            if strict:
                raise ConfigError(f"cannot use --dataset-config {self.path}: {exc}") from exc
            log.error("dataset config: keeping the rules in force; %s could not be used: %s",
                      self.path, exc)
            return False
        self._stamp = stamp_of(st)
        changed = (default, rules) != (self.default, self.rules)
        self.default, self.rules = default, rules
        if changed and not strict:
            log.info("dataset config: rules for %d datasets from %s", len(rules), self.path)
        if changed:
            for fn in self.on_change:
                fn()
        return changed

    def reload_if_changed(self) -> bool:
        if self.path is None:
            return False
        stamp = file_stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return False
        return self.reload()

    def describe(self) -> dict[str, object]:
        return {"file": str(self.path) if self.path else None,
                "default": asdict(self.default),
                "datasets": {k: asdict(v) for k, v in sorted(self.rules.items())}}
