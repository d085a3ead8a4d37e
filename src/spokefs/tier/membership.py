"""Which tier members are answering: states fed by the outcome of requests, with the clock
passed in (no I/O, no timers of its own).

Listing and health are kept apart on purpose. The list (from ``--tier``, DNS or Kubernetes)
decides ownership: the rendezvous ranking is computed over every listed member. Health only
decides whom a request skips: a member that stops answering keeps its keys in the ranking,
its blocks are asked of the next member in their ranking meanwhile, and when it answers again
it serves its share from the cache it kept, with nothing to move back.

States:
- ``up``: answering (or new, or not asked yet).
- ``suspect``: its last request failed or timed out; it is still asked (a single lost
  connection should not move its share), each request bounded by the caller's timeout.
- ``down``: skipped. A suspect member is down once it has failed ``down_failures`` times in a
  row, or ``down_after`` seconds have passed since its first failure without an answer,
  whichever is first. A down member is probed (``probes_due``) after ``retry_after``, then at
  doubling intervals up to ``retry_max``; the first answer, probe or not, makes it up again.

This member itself is never suspect or down: it does not ask itself over the network.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from spokefs.errors import ConfigError
from spokefs.tier.rendezvous import normalise_url

__all__ = ["Health", "Membership", "State"]


class State(enum.StrEnum):
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"


@dataclass
class Health:
    url: str
    state: State = State.UP
    since: float = 0.0                 # when it entered this state
    failures: int = 0                  # in a row, since its last answer
    first_failure: float | None = None
    last_answer: float | None = None
    last_error: str | None = None      # "failed" or "timed_out", for status pages
    retry_at: float | None = None      # when a down member is next probed
    retry_delay: float = 0.0
    probing: bool = field(default=False, repr=False)


class Membership:
    """The listed members and their health.

    ``update`` replaces the list (from a source); ``answered``, ``failed`` and ``timed_out``
    report each request's outcome; ``candidates`` orders the members to ask for a block from
    its rendezvous ranking; ``probes_due`` says which down members to probe now.
    """

    def __init__(self, members: Iterable[str], now: float, *, self_url: str | None = None,
                 down_failures: int = 3, down_after: float = 5.0, retry_after: float = 1.0,
                 retry_max: float = 30.0) -> None:
        if down_failures < 1:
            raise ConfigError(f"down_failures must be at least 1, not {down_failures}")
        if not (down_after > 0 and 0 < retry_after <= retry_max):
            raise ConfigError("down_after, retry_after and retry_max must be positive, "
                              "retry_after <= retry_max")
        self.self_url = normalise_url(self_url) if self_url else None
        self.down_failures = down_failures
        self.down_after = down_after
        self.retry_after = retry_after
        self.retry_max = retry_max
        self._health: dict[str, Health] = {}
        self.update(members, now)

    # -- the list ---------------------------------------------------------------------------

    def update(self, members: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """Replace the member list; members kept keep their health, new ones start up.
        Returns (added, removed), each sorted."""
        names = {normalise_url(m) for m in members}
        if self.self_url is not None:
            names.add(self.self_url)  # a member always counts itself (its source may lag)
        added = sorted(names - self._health.keys())
        removed = sorted(self._health.keys() - names)
        for name in removed:
            del self._health[name]
        for name in added:
            self._health[name] = Health(name, since=now)
        return added, removed

    @property
    def members(self) -> list[str]:
        """Every listed member, whatever its state: what ownership is computed over."""
        return sorted(self._health)

    def health(self, url: str) -> Health | None:
        return self._health.get(normalise_url(url))

    # -- events -----------------------------------------------------------------------------

    def answered(self, url: str, now: float) -> None:
        """A request to ``url`` got an answer (any HTTP answer: the member is alive)."""
        h = self._health.get(normalise_url(url))
        if h is None:
            return
        if h.state is not State.UP:
            h.state, h.since = State.UP, now
        h.failures, h.first_failure, h.last_answer = 0, None, now
        h.retry_at, h.retry_delay, h.probing = None, 0.0, False

    def failed(self, url: str, now: float) -> None:
        """A request to ``url`` could not connect, was reset, or got a 5xx from the server
        itself (not one it relayed from upstream)."""
        self._failure(url, now, "failed")

    def timed_out(self, url: str, now: float) -> None:
        """A request to ``url`` got no answer within the caller's timeout."""
        self._failure(url, now, "timed_out")

    def _failure(self, url: str, now: float, kind: str) -> None:
        name = normalise_url(url)
        h = self._health.get(name)
        if h is None or name == self.self_url:
            return
        h.failures += 1
        h.last_error = kind
        if h.first_failure is None:
            h.first_failure = now
        if h.state is State.DOWN:
            if h.probing:  # a failed probe: wait longer before the next one
                h.probing = False
                h.retry_delay = min(self.retry_max, max(self.retry_after, 2 * h.retry_delay))
                h.retry_at = now + h.retry_delay
            return  # else a request sent before it went down: the probe schedule stands
        if h.state is State.UP:
            h.state, h.since = State.SUSPECT, now
        self._advance(h, now)

    def _advance(self, h: Health, now: float) -> None:
        """Suspect to down once it has failed too often or for too long."""
        if h.state is not State.SUSPECT or h.first_failure is None:
            return
        if h.failures >= self.down_failures or now - h.first_failure >= self.down_after:
            h.state, h.since = State.DOWN, now
            h.retry_delay = self.retry_after
            h.retry_at = now + h.retry_delay
            h.probing = False

    # -- questions --------------------------------------------------------------------------

    def state(self, url: str, now: float) -> State | None:
        h = self._health.get(normalise_url(url))
        if h is None:
            return None
        self._advance(h, now)
        return h.state

    def candidates(self, ranked: Iterable[str], now: float) -> list[str]:
        """The members of a rendezvous ranking to ask, in order: down ones and unlisted ones
        left out. The caller goes down this list (each try bounded by its timeout), then to
        the upstream."""
        out = []
        for url in ranked:
            h = self._health.get(url)
            if h is None:
                continue
            self._advance(h, now)
            if h.state is not State.DOWN:
                out.append(url)
        return out

    def probes_due(self, now: float) -> list[str]:
        """Down members whose next probe is due; each is returned once until its outcome is
        reported (``answered``, ``failed`` or ``timed_out``)."""
        due = []
        for h in self._health.values():
            self._advance(h, now)
            if (h.state is State.DOWN and not h.probing and h.retry_at is not None
                    and now >= h.retry_at):
                h.probing = True
                due.append(h.url)
        return sorted(due)

    def next_deadline(self, now: float) -> float | None:
        """The earliest time a state may change or a probe fall due with no event: when the
        driver should call ``probes_due`` next (None: nothing pending)."""
        times = []
        for h in self._health.values():
            if h.state is State.SUSPECT and h.first_failure is not None:
                times.append(h.first_failure + self.down_after)
            elif h.state is State.DOWN and not h.probing and h.retry_at is not None:
                times.append(h.retry_at)
        return max(now, min(times)) if times else None

    def snapshot(self, now: float,
                 shares: dict[str, float] | None = None) -> list[dict[str, object]]:
        """The members for ``/v1/status``: url, state, seconds in it, failures in a row, last
        error, share of the keys (when given), and which one is this member."""
        out = []
        for name in sorted(self._health):
            h = self._health[name]
            self._advance(h, now)
            row: dict[str, object] = {
                "url": name, "state": str(h.state), "for_s": round(now - h.since, 3),
                "failures": h.failures, "last_error": h.last_error,
                "self": name == self.self_url}
            if shares is not None:
                row["share"] = shares.get(name, 0.0)
            out.append(row)
        return out
