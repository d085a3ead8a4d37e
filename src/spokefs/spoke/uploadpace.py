"""Write-back uploads yield to reads (policy, no I/O): while the spoke's readers wait on the
upstream, an upload to the hub holds its next piece, but never longer than ``most_held``, so
a checkpoint is never starved by a long epoch of reads and still reaches the hub.

Why only a hold and not a rate: reads and uploads cross the link in opposite directions
(hub to spoke, spoke to hub); what they share is the spoke's and the hub's CPU, the hub's
disk and, on a half-duplex or shared path, the link itself. A hold while reads wait gives
those to the reads first, and costs nothing when nobody reads.

Fed with ``now`` and whether reads wait, ``UploadPacer.hold`` answers how long the next
piece waits before it is sent (0: at once); ``WriteBack`` sleeps that long, in steps of
``step``, asking again each step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class UploadPacer:
    most_held: float = 1.0   # seconds a piece may wait behind reads, at most
    step: float = 0.05       # seconds between looks while it waits
    held_s: float = 0.0      # seconds uploads were held behind reads, in all (a metric)
    _since: float | None = None  # when the piece now held began waiting

    def hold(self, now: float, reads_waiting: bool) -> float:
        """Seconds the next piece waits before asking again; 0: send it now."""
        if not reads_waiting:
            self._end(now)
            return 0.0
        if self._since is None:
            self._since = now
        if now - self._since >= self.most_held:
            self._end(now)  # held long enough: one piece goes, then it yields again
            return 0.0
        return min(self.step, self.most_held - (now - self._since))

    def _end(self, now: float) -> None:
        if self._since is not None:
            self.held_s += now - self._since
            self._since = None
