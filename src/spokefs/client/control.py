"""Talking to a spoke's control routes from plain Python: orders, epochs, warm-up, residency.

    from spokefs.client.control import SpokeControl
    ctl = SpokeControl("http://spoke:8471/imagenet", job="resnet-run-7")
    ctl.announce(epoch, paths_in_the_order_they_will_be_read)
    ctl.warm(prefix="train", wait=True)          # progress bar; returns when resident

A warm-up runs on the spoke, in the background; ``warm(wait=True)`` follows it and ends in
one of three ways: every byte resident (returns the residency), the spoke's warm-ups of the
dataset over with some files not resident (``WarmIncomplete``: their blocks failed, or were
evicted again), or ``timeout`` reached (``WarmTimedOut``; the spoke goes on).
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from spokefs.client.sync import Client
from spokefs.client.urls import parse_url
from spokefs.manifest import Manifest

NAMED = 10            # files not resident named by WarmIncomplete, at most
_SLICE = 10_000       # files per residency request when looking for the missing ones
SETTLE_S = 2.0        # residency unchanged this long after the warm-ups ended: what it is


@dataclass
class Missing:
    """Files of a warm-up's set that are not (wholly) resident: the first ``NAMED`` (path,
    bytes not resident), and how many files and bytes in all."""

    files: int
    bytes: int
    named: list[tuple[str, int]] = field(default_factory=list)


class WarmIncomplete(Exception):
    """The spoke's warm-ups of the dataset ended and some of the set is not resident: its
    blocks failed to arrive (the spoke's log says why: the upstream unreachable past the
    deadline, a file changed at the source...) or were evicted again (a set larger than the
    cache)."""

    def __init__(self, residency: dict[str, Any], missing: Missing) -> None:
        self.residency = residency
        self.missing = missing
        names = ", ".join(p for p, _ in missing.named)
        more = missing.files - len(missing.named)
        super().__init__(f"warm-up ended with {missing.files} of {residency['files']} files "
                         f"not resident ({missing.bytes:,} bytes): {names}"
                         + (f" and {more} more" if more > 0 else ""))


class WarmTimedOut(TimeoutError):
    """``timeout`` passed before the set was resident (the spoke goes on warming)."""

    def __init__(self, timeout: float, residency: dict[str, Any]) -> None:
        self.residency = residency
        super().__init__(f"warm-up not done after {timeout:g}s: {residency['fraction']:.1%} "
                         "resident")


@dataclass(frozen=True)
class Fit:
    """A set's size against the room a spoke gives it: its cache, or the dataset's share
    of it (``max_share`` in the spoke's dataset rules). ``room`` None: not known."""

    bytes: int
    room: int | None
    limit: str  # "the cache" or "the dataset's share of the cache"

    @property
    def fits(self) -> bool:
        return self.room is None or self.bytes <= self.room


class SpokeControl:
    def __init__(self, url: str, job: str = "default", deadline: float = 30.0) -> None:
        u = parse_url(url)
        self.client = Client(u.base, deadline=deadline)
        self.dataset = u.dataset
        self.snapshot = u.snapshot
        self.job = job

    def _post(self, path: str, doc: dict[str, Any]) -> dict[str, Any]:
        body = gzip.compress(json.dumps(doc).encode(), compresslevel=3)
        resp = self.client.request("POST", path, {"Content-Type": "application/json",
                                                  "Content-Encoding": "gzip"}, body)
        return dict(json.loads(resp.data))

    def _select(self, paths: Sequence[str] | None = None, indexes: Sequence[int] | None = None,
                prefix: str | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {"snapshot": self.snapshot}
        if indexes is not None:
            doc["indexes"] = list(indexes)
        elif paths is not None:
            doc["paths"] = list(paths)
        else:
            doc["prefix"] = prefix or ""
        return doc

    def announce(self, epoch: int, paths: Sequence[str] | None = None,
                 indexes: Sequence[int] | None = None,
                 ranges: Sequence[tuple[int, int]] | None = None) -> dict[str, Any]:
        """Tell the spoke the order this job will read in ``epoch`` (paths or manifest
        indexes; ``ranges`` = one (offset, length) per entry for samples inside shards)."""
        doc = self._select(paths, indexes)
        doc["epoch"] = epoch
        if ranges is not None:
            doc["ranges"] = [list(r) for r in ranges]
        return self._post(f"/v1/datasets/{self.dataset}/jobs/{self.job}/order", doc)

    def epoch(self, epoch: int) -> dict[str, Any]:
        return self._post(f"/v1/datasets/{self.dataset}/jobs/{self.job}/epoch",
                          {"epoch": epoch})

    def report_steps(self, steps: Sequence[tuple[float, float]]) -> dict[str, Any]:
        """Tell the spoke about this job's batches: ``(data_wait_s, step_s)`` each, at most
        4096 a call (``spokefs.torch.StepReporter`` batches them in the background)."""
        return self._post(f"/v1/datasets/{self.dataset}/jobs/{self.job}/steps",
                          {"steps": [list(s) for s in steps]})

    def end(self) -> None:
        self.client.request("DELETE", f"/v1/datasets/{self.dataset}/jobs/{self.job}")

    def unpin(self, paths: Sequence[str] | None = None, prefix: str | None = None
              ) -> dict[str, Any]:
        """Release what a pinned warm-up pinned of these files (they stay cached)."""
        return self._post(f"/v1/datasets/{self.dataset}/unpin",
                          self._select(paths, None, prefix))

    def residency(self, paths: Sequence[str] | None = None, prefix: str | None = None
                  ) -> dict[str, Any]:
        return self._post(f"/v1/datasets/{self.dataset}/residency",
                          self._select(paths, None, prefix))

    def fit(self, paths: Sequence[str] | None = None, prefix: str | None = None) -> Fit:
        """Whether these files fit the spoke: its cache, or the dataset's share of it."""
        size = int(self.residency(paths, prefix)["bytes"])
        status = self.client.get_json("/v1/status")
        cache = status.get("cache") or {}
        capacity = cache.get("capacity_bytes")
        if not isinstance(capacity, int):
            return Fit(size, None, "the cache")
        rules = status.get("datasets") or {}
        mine = (rules.get("datasets") or {}).get(self.dataset) or rules.get("default") or {}
        share = mine.get("max_share")
        if isinstance(share, int | float) and share < 1:
            return Fit(size, int(share * capacity), "the dataset's share of the cache")
        return Fit(size, capacity, "the cache")

    def warm(self, paths: Sequence[str] | None = None, prefix: str | None = None,
             pin: bool = False, wait: bool = False, progress: bool | None = True,
             timeout: float | None = None, poll: float = 0.5) -> dict[str, Any]:
        """Fill the spoke with these files. Without ``wait``: what the spoke set out to do.
        With ``wait``: follow it (a tqdm bar; ``progress`` None: only on a terminal) until
        every byte is resident (the residency), else ``WarmIncomplete`` once the spoke's
        warm-ups of the dataset ended without it, or ``WarmTimedOut`` after ``timeout``."""
        doc = self._select(paths, None, prefix)
        doc["pin"] = pin
        before = self._warm_counts() if wait else (0, 0)
        started = self._post(f"/v1/datasets/{self.dataset}/warm", doc)
        self.snapshot = started["snapshot"]  # poll the snapshot that is being warmed
        if not wait:
            return started
        end = None if timeout is None else time.monotonic() + timeout
        ended_at: float | None = None  # since when the warm-ups are over and nothing lands
        last, asked_at = -1, 0.0
        with tqdm(total=started["bytes"], unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"warming {started['files']} files",
                  disable=None if progress is None else not progress) as bar:
            while True:
                r = self.residency(paths, prefix)
                bar.update(r["resident_bytes"] - bar.n)
                bar.set_postfix(files=f"{r['resident_files']}/{r['files']}")
                if r["resident_bytes"] >= r["bytes"]:
                    return r
                now = time.monotonic()
                if r["resident_bytes"] != last:  # still landing: not over yet
                    last, ended_at = r["resident_bytes"], None
                elif ended_at is None and now - asked_at >= 1.0:  # nothing landed: over?
                    asked_at = now  # (its metrics at most once a second: a scrape costs)
                    if self._warm_over(before, started["blocks_to_fetch"]):
                        ended_at = now
                elif ended_at is not None and now - ended_at >= SETTLE_S:  # over, nothing since
                    raise WarmIncomplete(r, self.missing(paths, prefix))
                if end is not None and now > end:
                    raise WarmTimedOut(timeout or 0.0, r)
                time.sleep(poll if end is None else max(0.0, min(poll, end - now)))

    def _warm_counts(self) -> tuple[float, float]:
        """(blocks the spoke's warm-ups of this dataset set out to fetch, blocks whose fetch
        ended), from its metrics (``spokefs_warm_blocks``, ``spokefs_warm_done_blocks``)."""
        text = self.client.request("GET", "/metrics").data.decode()
        counts = {"spokefs_warm_blocks": 0.0, "spokefs_warm_done_blocks": 0.0}
        for family in text_string_to_metric_families(text):
            if family.name in counts:
                counts[family.name] = sum(s.value for s in family.samples
                                          if s.name.endswith("_total")
                                          and s.labels.get("dataset") == self.dataset)
        return counts["spokefs_warm_blocks"], counts["spokefs_warm_done_blocks"]

    def _warm_over(self, before: tuple[float, float], blocks: int) -> bool:
        """Whether this warm-up's fetches all ended (so did any other of the dataset's):
        as many fetches ended since it was asked for as it had blocks to fetch, and no
        warm-up of the dataset has a fetch still to end."""
        asked, done = self._warm_counts()
        return done - before[1] >= blocks and done >= asked

    def missing(self, paths: Sequence[str] | None = None, prefix: str | None = None,
                most: int = NAMED) -> Missing:
        """The files of the set not wholly resident: how many, and the first ``most`` by
        path with the bytes each lacks (residency asked of slices, then halves of the
        slices that lack some)."""
        snap = self.client.resolve(self.dataset, self.snapshot or "latest")
        m = self.client.manifest(self.dataset, snap)
        files = _selected(m, paths, prefix)
        total = Missing(0, 0)
        todo = collections.deque(files[i:i + _SLICE] for i in range(0, len(files), _SLICE))
        while todo:
            part = todo.popleft()
            r = self._post(f"/v1/datasets/{self.dataset}/residency",
                           {"snapshot": snap, "indexes": part})
            lacking = r["files"] - r["resident_files"]
            if lacking == 0:
                continue
            if len(part) > 1 and len(total.named) < most:
                half = len(part) // 2
                todo.extendleft([part[half:], part[:half]])  # depth first: the first by path
                continue
            if len(part) == 1 and len(total.named) < most:
                total.named.append((m.paths[part[0]], r["bytes"] - r["resident_bytes"]))
            total.files += lacking
            total.bytes += r["bytes"] - r["resident_bytes"]
        return total


def _selected(m: Manifest, paths: Sequence[str] | None, prefix: str | None) -> list[int]:
    """The manifest indexes a warm-up's selection names, as the spoke selects them
    (``spoke.routes.select_files``)."""
    if paths is not None:
        out = [m.index(p.strip("/")) for p in paths]
        return [i for i in out if i is not None]
    prefix = (prefix or "").strip("/")
    i = m.index(prefix) if prefix else None
    if i is not None:
        return [i]
    start = f"{prefix}/" if prefix else ""
    lo = bisect.bisect_left(m.paths, start)
    hi = bisect.bisect_left(m.paths, start + "\U0010ffff")
    return list(range(lo, hi))
