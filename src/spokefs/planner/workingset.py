"""Working-set learning without hints: spot an epoch scan, predict the rest, remember it.

An epoch scan reads distinct files, each once, in any order. After ``threshold`` distinct
files with few re-reads, the scan is *detected*; the predicted working set is the manifest
subtree under the common directory of every file read so far (it widens as reads spread).
A re-read of a file read earlier in the epoch (not one of the last few, which may still be in
progress) starts the next epoch once half the prediction was read, or after ``threshold``
such re-reads (a job that reads a subset each epoch). From then on the prediction is exactly
the set of files the last epoch read: the learned working set, which ``WorkingSet`` carries
across restarts (by path ranges, so it survives a new snapshot of the same tree).

Per file, one byte of flags (``bytearray`` over the manifest): a million files cost 1 MB.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from spokefs.planner.manifest import Manifest, common_dir, parent_dir

SEEN = 1  # read in the current epoch
PREV = 2  # read in the last complete epoch (the learned working set)
KEEP = 4  # chosen to stay resident (pinned)
ENDGAME = 8  # prefetched near the end of an epoch, pinned until read

# flags.translate(_ROLL) starts an epoch: SEEN becomes PREV, ENDGAME and SEEN clear.
_ROLL = bytes(((v & KEEP) | (PREV if v & SEEN else 0)) for v in range(256))


@dataclass(frozen=True)
class WorkingSet:
    """What a job read in its last complete epoch, serialisable as JSON."""

    dataset: str
    job: str
    prefix: str
    ranges: list[tuple[str, str]] = field(default_factory=list)  # inclusive path ranges
    files: int = 0
    bytes: int = 0
    epochs: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset, "job": self.job, "prefix": self.prefix,
            "ranges": [list(r) for r in self.ranges], "files": self.files,
            "bytes": self.bytes, "epochs": self.epochs,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkingSet:
        return cls(
            dataset=str(data["dataset"]), job=str(data.get("job", "")),
            prefix=str(data.get("prefix", "")),
            ranges=[(str(a), str(b)) for a, b in data.get("ranges", [])],
            files=int(data.get("files", 0)), bytes=int(data.get("bytes", 0)),
            epochs=int(data.get("epochs", 0)),
        )  # fmt: skip


class ScanState:
    """Learning state of one (dataset, job)."""

    def __init__(self, manifest: Manifest, threshold: int, recent: int = 16) -> None:
        self.m = manifest
        self.threshold = max(2, threshold)
        self.flags = bytearray(len(manifest))
        self.epoch = 0  # epochs completed
        self.distinct = 0  # files read this epoch
        self.distinct_bytes = 0
        self.rereads = 0
        self.prefix: str | None = None
        self.detected = False
        self.prev_files = 0
        self.prev_bytes = 0
        self.last_index = -1  # the file read last (where a sorted scan is)
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._recent_max = recent
        self.last_now = 0.0

    # -- the prediction -----------------------------------------------------------------
    @property
    def learned(self) -> bool:
        return self.prev_files > 0

    def subtree(self) -> range:
        return self.m.subtree(self.prefix or "")

    def predicted_range(self) -> range:
        """Where predicted files lie (test ``in_prediction`` inside it)."""
        return range(len(self.m)) if self.learned else self.subtree()

    def in_prediction(self, i: int) -> bool:
        return bool(self.flags[i] & PREV) if self.learned else i in self.subtree()

    def predicted_bytes(self) -> int:
        return self.prev_bytes if self.learned else self.m.bytes_in(self.subtree())

    def predicted_files(self) -> int:
        return self.prev_files if self.learned else len(self.subtree())

    # -- reads ----------------------------------------------------------------------------
    def on_read(self, i: int, now: float = 0.0) -> str | None:
        """Record a read of file ``i``. Returns "detected" (the scan was just recognised),
        "widened" (the predicted subtree grew), "epoch" (a new epoch started) or None."""
        self.last_now = now
        flags = self.flags
        result = None
        if flags[i] & SEEN:
            if i in self._recent:  # the same file still being read (chunks, workers)
                return None
            self.rereads += 1
            half = self.detected and 2 * self.distinct >= self.predicted_files()
            if not (half or self.rereads >= self.threshold):
                return None
            self.new_epoch()
            result = "epoch"
        flags[i] |= SEEN
        self.distinct += 1
        self.distinct_bytes += self.m.sizes[i]
        self.last_index = i
        self._recent[i] = None
        if len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)
        if not self.learned:
            d = parent_dir(self.m.paths[i])
            old = self.prefix
            self.prefix = d if old is None else common_dir(old, d)
            if not self.detected:
                if self.distinct >= self.threshold and 2 * self.rereads < self.threshold:
                    self.detected = True
                    return "detected"
            elif self.prefix != old:
                return "widened"
        return result

    def new_epoch(self) -> None:
        if self.distinct == 0:
            return
        self.flags = self.flags.translate(_ROLL)
        self.prev_files, self.prev_bytes = self.distinct, self.distinct_bytes
        self.epoch += 1
        self.distinct = self.distinct_bytes = self.rereads = 0
        self.detected = True
        self._recent.clear()

    # -- persistence ------------------------------------------------------------------------
    def working_set(self, dataset: str, job: str) -> WorkingSet:
        """The last complete epoch's files, or this epoch's so far when none completed."""
        bit = PREV if self.learned else SEEN
        paths, flags = self.m.paths, self.flags
        ranges: list[tuple[str, str]] = []
        start = -1
        for i in range(len(flags) + 1):
            on = i < len(flags) and bool(flags[i] & bit)
            if on and start < 0:
                start = i
            elif not on and start >= 0:
                ranges.append((paths[start], paths[i - 1]))
                start = -1
        files = self.prev_files if self.learned else self.distinct
        size = self.prev_bytes if self.learned else self.distinct_bytes
        return WorkingSet(dataset, job, self.prefix or "", ranges, files, size, self.epoch)

    def restore(self, ws: WorkingSet) -> None:
        """Take ``ws`` as the last epoch's files (paths not in this manifest are skipped)."""
        m, flags = self.m, self.flags
        files = size = 0
        for first, last in ws.ranges:
            for i in range(bisect_left(m.paths, first), bisect_right(m.paths, last)):
                if not flags[i] & PREV:
                    flags[i] |= PREV
                    files += 1
                    size += m.sizes[i]
        self.prev_files, self.prev_bytes = files, size
        self.prefix = ws.prefix
        self.epoch = max(self.epoch, ws.epochs, 1 if files else 0)
        self.detected = files > 0
