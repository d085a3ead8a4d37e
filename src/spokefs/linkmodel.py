"""How much the link to the upstream needs in flight, measured from the fetches (sans-I/O).

Prefetch must keep the link busy without standing in front of a reader: the link shares its
bandwidth among the requests on it, so a demand miss issued behind 64 prefetches gets 1/65 of
the link. Enough in flight is about the bandwidth-delay product; twice that absorbs the
estimate's noise and the gaps between one response and the next request (BBR's cwnd gain).

The model is fed every upstream request the spoke makes -- ``sent(now)`` when it goes out,
``received(nbytes)`` as pieces of any response arrive, ``delivered(sent, nbytes, now,
first_byte)`` when a response is complete -- and estimates, in the manner of BBR (Cardwell
et al., ACM Queue 2016):

- ``rtt``: the minimum time to the response's first byte over ``rtt_window`` seconds. Under
  load every sample includes queueing, so when the minimum is that old it is re-measured: the
  window drops to ``min_window`` for ``probe_time`` plus two round trips (the queue drains),
  and the least sample sent during that probe becomes the new minimum.
- ``bandwidth``: the maximum delivery rate over ``bw_window`` seconds, a sample being the
  bytes delivered (by any request) while one request was outstanding over its lifetime. A
  sample sent while nothing waited to go out (``app_limited``) measures the demand, not the
  link, and counts only when it raises the estimate. With no recent samples the last
  estimate stands.
- ``window()``: ``gain x bandwidth x rtt`` clamped to ``[min_window, max_window]``. A
  window smaller than the link's need shows up as a delivery rate of window / rtt, so the
  next window is larger: it grows each round trip until the link is full, and shrinks when
  the delivered rate falls (another user on the link). At first (BBR's startup) the gain is
  ``startup_gain`` and the window at least ``initial_window``, so a fast link fills in a few
  round trips; startup ends once three rounds (a round: until a request sent after its
  start is delivered) brought less than 25% more bandwidth, with a probe of the rtt (what
  startup queued drains, and the first samples, taken in a burst, are replaced).

Times are seconds from any monotonic clock the caller likes; nothing here reads one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sent:
    """What the model remembers of a request while it is outstanding."""

    at: float
    delivered: int       # bytes the link had delivered when this request went out
    app_limited: bool    # nothing else was waiting to go out


class LinkModel:
    def __init__(self, *, gain: float = 2.0, startup_gain: float = 2.89,
                 min_window: int = 256 << 10, max_window: int = 256 << 20,
                 initial_window: int = 256 << 10, rtt_window: float = 10.0,
                 bw_window: float = 2.0, probe_time: float = 0.2) -> None:
        if not 0 < min_window <= max_window:
            raise ValueError(f"need 0 < min_window <= max_window, got {min_window}, "
                             f"{max_window}")
        self.gain = gain
        self.startup_gain = startup_gain
        self.min_window = min_window
        self.max_window = max_window
        self.initial_window = max(min_window, min(initial_window, max_window))
        self.rtt_window = rtt_window
        self.bw_window = bw_window
        self.probe_time = probe_time
        self.rtt: float | None = None          # least time to first byte, seconds
        self.bandwidth: float | None = None    # bytes per second
        self.delivered_bytes = 0
        self.samples = 0
        self.probes = 0
        self._rtt_at = 0.0                     # when the current minimum was (re)confirmed
        self._probe_from: float | None = None  # a probe of the rtt began here
        self._probe_min: float | None = None
        self._rates: deque[tuple[float, float]] = deque()  # (time, rate), rates decreasing
        self.startup = True
        self._round_end = 0      # delivered_bytes at which the current round ends
        self._full_bw = 0.0      # bandwidth at the last round that grew it by 25%
        self._flat_rounds = 0

    # -- events in ---------------------------------------------------------------------------
    def sent(self, now: float, app_limited: bool = False) -> Sent:
        return Sent(now, self.delivered_bytes, app_limited)

    def received(self, nbytes: int) -> None:
        """Bytes of some response arrived (counting them as they come, not when a response
        completes, keeps the rate smooth when many responses end together)."""
        self.delivered_bytes += nbytes

    def delivered(self, sent: Sent, nbytes: int, now: float,
                  first_byte: float | None = None) -> None:
        """A request's whole response arrived at ``now``, its headers at ``first_byte``
        (``now`` when not known); ``nbytes``: those of its bytes not yet ``received()``."""
        self.delivered_bytes += nbytes
        self.samples += 1
        self._on_rtt(max(0.0, (now if first_byte is None else first_byte) - sent.at), sent,
                     now)
        elapsed = now - sent.at
        if elapsed > 0:
            rate = (self.delivered_bytes - sent.delivered) / elapsed
            if not sent.app_limited or self.bandwidth is None or rate > self.bandwidth:
                self._on_rate(rate, now)
        if sent.delivered >= self._round_end:  # a round trip's worth of requests is back
            self._round_end = self.delivered_bytes
            if self.startup and not sent.app_limited and self.bandwidth is not None:
                if self.bandwidth >= 1.25 * self._full_bw:
                    self._full_bw, self._flat_rounds = self.bandwidth, 0
                else:
                    self._flat_rounds += 1
                    if self._flat_rounds >= 3:  # the pipe is full; drain what startup
                        self.startup = False    # queued and measure the rtt without it
                        self._start_probe(now)

    def _on_rtt(self, rtt: float, sent: Sent, now: float) -> None:
        if self._probe_from is not None:
            if sent.at >= self._probe_from:
                self._probe_min = rtt if self._probe_min is None else min(self._probe_min,
                                                                          rtt)
            if self._probe_min is not None and now >= self._probe_end():
                self.rtt, self._rtt_at = self._probe_min, now
                self._probe_from = self._probe_min = None
            return
        if self.rtt is None or rtt <= self.rtt * 1.1 + 0.001:
            # A new minimum, or the old one seen again (not just queueing): still true.
            self.rtt = rtt if self.rtt is None else min(self.rtt, rtt)
            self._rtt_at = now
        elif now - self._rtt_at > self.rtt_window:
            self._start_probe(now)

    def _start_probe(self, now: float) -> None:
        if self._probe_from is None:
            self._probe_from, self._probe_min = now, None
            self.probes += 1

    def _probe_end(self) -> float:
        assert self._probe_from is not None
        return self._probe_from + self.probe_time + 2 * (self.rtt or 0.0)

    def _on_rate(self, rate: float, now: float) -> None:
        # A monotonic deque: the front is the largest rate seen in the last bw_window.
        while self._rates and self._rates[-1][1] <= rate:
            self._rates.pop()
        self._rates.append((now, rate))
        while self._rates[0][0] < now - self.bw_window:  # the new sample always stays
            self._rates.popleft()
        self.bandwidth = self._rates[0][1]

    # -- answers -----------------------------------------------------------------------------
    @property
    def probing(self) -> bool:
        return self._probe_from is not None

    def window(self) -> int:
        """Bytes of prefetch to keep outstanding now."""
        if self._probe_from is not None:
            return self.min_window
        if self.rtt is None or self.bandwidth is None:
            return self.initial_window
        if self.startup:
            want = max(self.initial_window, self.startup_gain * self.bandwidth * self.rtt)
        else:
            want = self.gain * self.bandwidth * self.rtt
        return int(max(self.min_window, min(want, self.max_window)))

    def stats(self) -> dict[str, float | int | bool | None]:
        return {"rtt_s": self.rtt, "bandwidth_bytes_per_s": self.bandwidth,
                "window_bytes": self.window(), "startup": self.startup,
                "probing": self.probing,
                "probes": self.probes, "samples": self.samples,
                "delivered_bytes": self.delivered_bytes}
