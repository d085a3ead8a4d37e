"""What training jobs say about their steps: data wait against compute, per (dataset, job).

A training loop (``spokefs.torch.StepReporter``) reports each batch as ``[data_wait_s,
step_s]``: the time it waited for the batch and the time it then spent on it (the step
proper: forward, backward, optimiser). That tells "the accelerator starves because of the
data" (a high data-wait share) from "it is busy" next to the cache's own state, which
hits and misses alone cannot: a miss the prefetcher hid costs the job nothing.

Sans-I/O: the spoke feeds reports with its clock's ``now`` and reads totals and shares back
(``/metrics``, ``/v1/status``). The number of jobs is bounded (the least recently heard
from is dropped first), and so is the history each keeps: the reports of the last
``window`` seconds, for the recent utilisation.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spokefs.errors import BadRequest

MAX_STEPS = 4096         # steps one report may carry (a reporter posts about once a second)
MAX_STEP_S = 86_400.0    # a step's wait or compute time, in seconds: a day is not a step
MAX_JOBS = 256           # jobs kept; past that the one heard from least recently is dropped
WINDOW_S = 30.0          # the recent window the utilisation is taken over
IDLE_DROP_S = 3600.0     # a job not heard from for this long is dropped


def check_steps(raw: Sequence[object], where: str = "steps") -> list[tuple[float, float]]:
    """``[[data_wait_s, step_s], ...]`` as floats, each a finite number in [0, MAX_STEP_S];
    otherwise a BadRequest naming the first bad entry (the list's length is the caller's
    to bound: ``routes.Fields.items``)."""
    out: list[tuple[float, float]] = []
    for i, item in enumerate(raw):
        if type(item) is list and len(item) == 2:
            wait, step = item
            # A boolean is no number (JSON true is not 1 second); NaN and inf are not times.
            if (type(wait) in (int, float) and type(step) in (int, float)
                    and math.isfinite(wait) and math.isfinite(step)
                    and 0 <= wait <= MAX_STEP_S and 0 <= step <= MAX_STEP_S):
                out.append((float(wait), float(step)))
                continue
        text = repr(item)
        raise BadRequest(f'"{where}[{i}]" must be [data_wait_s, step_s], two numbers of '
                         f"seconds in [0, {MAX_STEP_S:g}], not "
                         f"{text if len(text) <= 60 else text[:57] + '...'}")
    return out


@dataclass
class JobSteps:
    """One job's totals and its recent reports: (when, steps, data wait, step time)."""

    dataset: str
    job: str
    steps: int = 0
    data_wait_s: float = 0.0
    step_s: float = 0.0
    last_seen: float = 0.0
    recent: deque[tuple[float, int, float, float]] = field(default_factory=deque)

    def recent_share(self) -> float | None:
        """The share of the recent window's time spent waiting for data (None: no time)."""
        wait = sum(r[2] for r in self.recent)
        busy = sum(r[3] for r in self.recent)
        return wait / (wait + busy) if wait + busy > 0 else None

    def describe(self) -> dict[str, Any]:
        share = self.recent_share()
        return {"dataset": self.dataset, "job": self.job, "steps": self.steps,
                "data_wait_share": share,
                "utilisation": None if share is None else 1.0 - share,
                "data_wait_s": self.data_wait_s, "step_s": self.step_s,
                "recent_steps": sum(r[1] for r in self.recent)}


class JobSignal:
    """Step reports of up to ``max_jobs`` jobs."""

    def __init__(self, max_jobs: int = MAX_JOBS, window: float = WINDOW_S,
                 idle_drop: float = IDLE_DROP_S) -> None:
        self.max_jobs = max_jobs
        self.window = window
        self.idle_drop = idle_drop
        self._jobs: OrderedDict[tuple[str, str], JobSteps] = OrderedDict()  # oldest first
        self.dropped = 0  # jobs dropped to stay within max_jobs or because idle

    def report(self, dataset: str, job: str, steps: Iterable[tuple[float, float]],
               now: float) -> JobSteps:
        """Add a report's steps (already checked: ``check_steps``) to the job's counts."""
        self.expire(now)
        key = (dataset, job)
        js = self._jobs.pop(key, None)
        if js is None:
            js = JobSteps(dataset, job)
            while len(self._jobs) >= self.max_jobs:
                self._jobs.popitem(last=False)
                self.dropped += 1
        self._jobs[key] = js  # the most recently heard from goes last
        n, wait, busy = 0, 0.0, 0.0
        for w, s in steps:
            n += 1
            wait += w
            busy += s
        js.steps += n
        js.data_wait_s += wait
        js.step_s += busy
        js.last_seen = now
        if n:
            js.recent.append((now, n, wait, busy))
        self._trim(js, now)
        return js

    def _trim(self, js: JobSteps, now: float) -> None:
        # The last report stays however old: a job that paused still shows its last state.
        while len(js.recent) > 1 and js.recent[0][0] < now - self.window:
            js.recent.popleft()

    def expire(self, now: float) -> None:
        """Drop jobs not heard from for ``idle_drop`` seconds."""
        while self._jobs:
            js = next(iter(self._jobs.values()))
            if js.last_seen >= now - self.idle_drop:
                break
            self._jobs.popitem(last=False)
            self.dropped += 1

    def jobs(self, now: float) -> list[JobSteps]:
        """Every job kept, by dataset and name, each trimmed to the recent window."""
        self.expire(now)
        for js in self._jobs.values():
            self._trim(js, now)
        return [self._jobs[k] for k in sorted(self._jobs)]

    def describe(self, now: float) -> list[dict[str, Any]]:
        """What ``/v1/status`` shows as ``"jobs"``."""
        return [js.describe() for js in self.jobs(now)]

    def __len__(self) -> int:
        return len(self._jobs)
