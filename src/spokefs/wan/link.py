"""The emulated link's settings and timing: when each chunk may be released, when a flow may read.

Sans-I/O: no sockets, no asyncio. The proxy tells a ``Flow`` "n bytes arrived" and gets back
the time to release them; time comes from an injected clock, so tests drive it by hand.

The model, per direction:

- one ``Serialiser`` per direction is the bottleneck shared by every connection: it puts one
  chunk after another on the wire at ``bandwidth`` (a virtual clock, ``free_at``);
- each chunk then flies for the one-way delay (rtt/2) plus a random share of ``jitter``, but a
  flow never releases a chunk before the one ahead of it (TCP does not reorder bytes);
- a flow keeps reading while earlier chunks are in flight (the pipe stays full), up to
  ``window`` bytes not yet acknowledged. A chunk is acknowledged one one-way delay after it is
  delivered, so one flow tops out at window/rtt, as with TCP;
- a flow stops reading while its last chunk waits more than ``QUEUE_S`` to get on the wire: a
  fast sender queues at the bottleneck rather than in our memory, and flows take turns;
- a new connection pays the handshake: nothing reaches the server before 1.5 rtt (SYN,
  SYN-ACK, then the first byte's one-way trip), nothing reaches the client before 1 rtt.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from spokefs.errors import ConfigError
from spokefs.units import parse_duration, parse_rate, parse_size

Clock = Callable[[], float]

# How far ahead a flow may book the shared wire before it must stop reading. Long enough to
# keep the wire busy between wake-ups, short enough that flows interleave fairly.
QUEUE_S = 0.005
# Without a window, bytes read but not yet delivered per flow and direction: bounds memory.
MAX_IN_FLIGHT = 64 * 1024 * 1024


@dataclass(frozen=True)
class LinkConfig:
    """What the link looks like. Seconds and bytes; ``None`` means no limit."""

    rtt: float = 0.0
    bandwidth: float | None = None  # bytes/s per direction, shared by all connections
    jitter: float = 0.0  # extra one-way delay per chunk, uniform in [0, jitter]
    window: int | None = None  # bytes in flight per connection and direction

    def __post_init__(self) -> None:
        if self.rtt < 0 or self.jitter < 0:
            raise ConfigError(f"rtt and jitter must be >= 0, got rtt={self.rtt} "
                              f"jitter={self.jitter}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ConfigError("bandwidth must be > 0 (use None or 0 in updated() for no cap)")
        if self.window is not None and self.window <= 0:
            raise ConfigError("window must be > 0 (use None or 0 in updated() for no limit)")

    @property
    def one_way(self) -> float:
        return self.rtt / 2

    def updated(self, **changes: object) -> LinkConfig:
        """A copy with ``changes`` parsed: rtt="60ms"|0.06, bandwidth="200MB/s"|bytes|0 (no cap),
        jitter="2ms"|0.002, window="1MiB"|bytes|0 (no limit). Raises ConfigError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"unknown link setting(s) {unknown}; known: {sorted(known)}")
        return replace(self, **{name: _PARSERS[name](value) for name, value in changes.items()})

    def to_json(self) -> dict[str, float | int | None]:
        return {"rtt": self.rtt, "bandwidth": self.bandwidth, "jitter": self.jitter,
                "window": self.window}


def _number_or(parse: Callable[[str], float]) -> Callable[[object], float]:
    def coerce(value: object) -> float:
        if isinstance(value, bool):  # bool is an int; "cut": true must not become 1 byte/s
            raise ConfigError(f"not a number: {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            return float(parse(value))
        raise ConfigError(f"expected a number or a string like '60ms' or '200MB/s', got {value!r}")
    return coerce


def _optional(coerce: Callable[[object], float], cast: type) -> Callable[[object], object]:
    def parse_limit(value: object) -> object:
        if value is None:
            return None
        number = coerce(value)
        return cast(number) if number > 0 else None  # 0 switches the limit off
    return parse_limit


_PARSERS: dict[str, Callable[[object], object]] = {
    "rtt": _number_or(parse_duration),
    "jitter": _number_or(parse_duration),
    "bandwidth": _optional(_number_or(parse_rate), float),
    "window": _optional(_number_or(parse_size), int),
}


def parse_address(text: str | tuple[str, int], default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"127.0.0.1:8080"``, ``"[::1]:0"``, ``":8080"`` or ``("host", port)`` -> (host, port)."""
    if isinstance(text, tuple):
        return text[0], int(text[1])
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"not a HOST:PORT address: {text!r} (try 127.0.0.1:8080; port 0 "
                          "picks a free one)")
    return host.strip("[]") or default_host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Serialiser:
    """The bottleneck of one direction: one chunk on the wire at a time, for every flow."""

    __slots__ = ("free_at",)

    def __init__(self) -> None:
        self.free_at = float("-inf")  # when the wire is next idle

    def reserve(self, now: float, nbytes: int, bandwidth: float | None) -> float:
        """Book ``nbytes`` after whatever is queued; return when their last byte leaves."""
        if bandwidth is None:
            return now
        self.free_at = max(now, self.free_at) + nbytes / bandwidth
        return self.free_at


class Link:
    """Settings, clock and the two shared serialisers; opens a pair of flows per connection."""

    def __init__(self, config: LinkConfig, clock: Clock,
                 rand: Callable[[], float] = random.random) -> None:
        self.config = config
        self.clock = clock
        self.rand = rand  # uniform in [0, 1): the jitter draw
        self.up = Serialiser()  # client -> upstream
        self.down = Serialiser()  # upstream -> client

    def open(self) -> tuple[Flow, Flow]:
        """Flows (up, down) of a connection accepted now, gated by the handshake."""
        now, rtt = self.clock(), self.config.rtt
        return (Flow(self, self.up, not_before=now + 1.5 * rtt),
                Flow(self, self.down, not_before=now + rtt))


class Flow:
    """One direction of one connection: release times, window credit and backlog."""

    __slots__ = ("_credits", "_link", "_wire", "in_flight", "last_depart", "last_release",
                 "not_before")

    def __init__(self, link: Link, wire: Serialiser, not_before: float = 0.0) -> None:
        self._link = link
        self._wire = wire
        self.not_before = not_before  # no release before the handshake completes
        self.last_release = float("-inf")
        self.last_depart = float("-inf")
        self.in_flight = 0  # bytes read and not yet credited back
        self._credits: deque[tuple[float, int]] = deque()  # (credit time, nbytes), in order

    def send(self, nbytes: int) -> float:
        """``nbytes`` arrived now: book the wire and return when to release them."""
        cfg, now = self._link.config, self._link.clock()
        depart = self._wire.reserve(now, nbytes, cfg.bandwidth)
        release = depart + cfg.one_way
        if cfg.jitter:
            release += cfg.jitter * self._link.rand()
        release = max(release, self.last_release, self.not_before)
        self.last_release = release
        self.last_depart = depart
        # With a window the sender hears of delivery one one-way trip later (the ACK).
        credit_at = release + cfg.one_way if cfg.window is not None else release
        self._credits.append((credit_at, nbytes))
        self.in_flight += nbytes
        return release

    def send_eof(self) -> float:
        """The sender closed now: when to pass the close on (after every byte before it)."""
        now = self._link.clock()
        return max(now + self._link.config.one_way, self.last_release, self.not_before)

    def room(self) -> int:
        """Bytes this flow may read now before its window (or memory bound) is full."""
        self._settle(self._link.clock())
        return max(0, self._limit() - self.in_flight)

    def wake_at(self) -> float | None:
        """None when the flow may read now; else the time at which to ask again."""
        now = self._link.clock()
        self._settle(now)
        wake = None
        if self.in_flight >= self._limit():
            wake = self._credits[0][0]
        if self.last_depart - now > QUEUE_S:
            wake = max(wake or now, self.last_depart - QUEUE_S)
        return wake

    def _limit(self) -> int:
        window = self._link.config.window
        return window if window is not None else MAX_IN_FLIGHT

    def _settle(self, now: float) -> None:
        credits = self._credits
        while credits and credits[0][0] <= now:
            self.in_flight -= credits.popleft()[1]
