"""The planner's parameters, shared by its parts (``CapacityChanged`` updates ``capacity``)."""

from __future__ import annotations

from dataclasses import dataclass

from spokefs.errors import ConfigError


@dataclass(slots=True)
class Settings:
    capacity: int
    max_inflight_bytes: int
    readahead_min_bytes: int
    readahead_max_bytes: int
    lookahead_bytes: int
    disorder_window: int
    scan_threshold: int
    reserve: int | None  # None: the default, see reserve_bytes
    learn: bool
    readahead: bool
    idle_timeout: float
    max_jobs: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("capacity", "max_inflight_bytes", "readahead_max_bytes",
                     "lookahead_bytes", "block_size"):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"planner {name} must be > 0 bytes, got {value}")

    @property
    def reserve_bytes(self) -> int:
        """Capacity learned working sets never take: room for demand misses, readahead and
        prefetches in flight."""
        if self.reserve is not None:
            return self.reserve
        return max(2 * self.block_size, min(self.max_inflight_bytes, self.capacity // 10))
