"""The training benchmark's figures, computed from a per-batch timeline (docs/benchmark.md).

Sans-I/O: plain records in, numbers out; no clock, no files. Every definition is the one in
docs/benchmark.md ("Definitions"); where a choice had to be made, it is written next to the
function and there.

Time model: a run starts at t=0 (before any setup the scenario charges to the job, e.g. the
staged copy). Batch i ends at ``t[i]``; its wall time is ``t[i] - t[i-1]`` (``t[-1] = 0``), which
holds its data wait, its compute and the loop's own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WINDOW = 20            # batches in the rolling AU window
STEADY_AU = 0.95       # the rolling AU a warm run never drops below
STALL_SHARE = 0.02     # a batch stalls when its data wait exceeds this share of its compute
# A scenario has warmed up once its rolling AU stays within this many AU points of the
# co-located run's at the same batch index (a dip both have is the loop's, not the data's).
LOCAL_MARGIN = 0.05


@dataclass(frozen=True, slots=True)
class Batch:
    epoch: int
    index: int          # batch index within its epoch
    t: float            # seconds from run start to the end of this batch's compute
    data_wait_s: float  # time the loop waited for this batch
    compute_s: float    # accelerator time (sleep or model step)
    samples: int
    bytes: int


def walls(timeline: Sequence[Batch]) -> list[float]:
    """Wall time of each batch: from the end of the previous one (or run start) to its end."""
    out, prev = [], 0.0
    for b in timeline:
        out.append(b.t - prev)
        prev = b.t
    return out


def au(timeline: Sequence[Batch]) -> float:
    """Accelerator utilisation: total compute / total wall (0.0 for an empty run)."""
    if not timeline or timeline[-1].t <= 0:
        return 0.0
    return min(1.0, sum(b.compute_s for b in timeline) / timeline[-1].t)


def epoch_spans(timeline: Sequence[Batch]) -> list[tuple[int, int]]:
    """[start, stop) batch positions of each epoch, in run order."""
    spans: list[tuple[int, int]] = []
    for i, b in enumerate(timeline):
        if not spans or timeline[spans[-1][0]].epoch != b.epoch:
            spans.append((i, i + 1))
        else:
            spans[-1] = (spans[-1][0], i + 1)
    return spans


def epoch_s(timeline: Sequence[Batch]) -> list[float]:
    """Wall seconds of each epoch (the first includes setup charged to the job)."""
    out = []
    for start, stop in epoch_spans(timeline):
        begin = timeline[start - 1].t if start else 0.0
        out.append(timeline[stop - 1].t - begin)
    return out


def _span_au(timeline: Sequence[Batch], start: int, stop: int) -> float:
    begin = timeline[start - 1].t if start else 0.0
    wall = timeline[stop - 1].t - begin
    compute = sum(b.compute_s for b in timeline[start:stop])
    return min(1.0, compute / wall) if wall > 0 else 0.0


def au_steady(timeline: Sequence[Batch]) -> float:
    """AU over the last epoch."""
    spans = epoch_spans(timeline)
    return _span_au(timeline, *spans[-1]) if spans else 0.0


def samples_per_s_steady(timeline: Sequence[Batch]) -> float:
    """Samples per second over the last epoch."""
    spans = epoch_spans(timeline)
    if not spans:
        return 0.0
    start, stop = spans[-1]
    wall = epoch_s(timeline)[-1]
    return sum(b.samples for b in timeline[start:stop]) / wall if wall > 0 else 0.0


def rolling_au(timeline: Sequence[Batch], window: int = WINDOW) -> list[float]:
    """AU of every run of ``window`` consecutive batches, indexed by the window's FIRST batch:
    value b covers batches b..b+window-1. A run shorter than the window has one value, over
    all of it; an empty run has none."""
    n = len(timeline)
    if n == 0:
        return []
    w = min(window, n)
    return [_span_au(timeline, b, b + w) for b in range(n - w + 1)]


def warmup(timeline: Sequence[Batch], window: int = WINDOW,
           threshold: float = STEADY_AU) -> tuple[int, bool]:
    """(warmup_batches, warmed_up).

    Defined as "the index of the first batch after which the rolling AU over 20 batches never
    drops below 0.95 (0 when it never does)". Read here as: the smallest batch index b such
    that every 20-batch window starting at b or later has AU >= 0.95. With K slow batches
    followed by fast ones this is K (the cold batches), not K+19 as a trailing window would
    say. Edge cases:
    - warm from the start (no window below the threshold): (0, True);
    - never warm (the last window is below the threshold): (0, False); the definition's "0 when it
      never does", so ``warmed_up`` is what tells it apart from warm-from-the-start;
    - a dip in the middle counts: warm-up ends after the last window that dips;
    - fewer batches than the window: one window over the whole run decides (0, True/False).
    """
    values = rolling_au(timeline, window)
    if not values:
        return 0, False
    if values[-1] < threshold:
        return 0, False
    last_bad = max((i for i, v in enumerate(values) if v < threshold), default=-1)
    return last_bad + 1, True


def warmup_vs(timeline: Sequence[Batch], reference: Sequence[Batch], window: int = WINDOW,
              margin: float = LOCAL_MARGIN) -> tuple[int, bool]:
    """(warmup_batches_vs_local, warmed_up_vs_local): the smallest batch index b such that
    every ``window``-batch window starting at b or later has a rolling AU at least
    ``reference``'s over the same batches minus ``margin``. ``reference`` is the co-located
    (``local``) run of the same benchmark run: a dip both runs have (an epoch boundary, the
    machine busy for everyone) cancels out, so what is left is the data path's own warm-up.
    Only the batches both runs have are compared. The reference against itself is (0, True);
    never within the margin (the last window is not): (0, False); no batches: (0, False)."""
    n = min(len(timeline), len(reference))
    ours = rolling_au(timeline[:n], window)
    theirs = rolling_au(reference[:n], window)
    if not ours:
        return 0, False
    behind = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a < b - margin]
    if behind and behind[-1] == len(ours) - 1:
        return 0, False
    return (behind[-1] + 1 if behind else 0), True


def stall_batches(timeline: Sequence[Batch], share: float = STALL_SHARE) -> int:
    """Batches whose data wait exceeded ``share`` of their compute time."""
    return sum(1 for b in timeline if b.data_wait_s > share * b.compute_s)


def time_to_steady_s(timeline: Sequence[Batch], warmup_batches: int,
                     warmed_up: bool) -> float | None:
    """Seconds from run start until the warm-up batches are done; None if never warm."""
    if not warmed_up:
        return None
    return timeline[warmup_batches - 1].t if warmup_batches else 0.0


def cost(wan_bytes: int, idle_s: float, price_per_gb: float,
         gpu_hour_price: float) -> dict[str, float]:
    """Dollars: bytes over the link (x price per GB, 1e9 bytes) plus accelerator idle time
    (wall - compute, x price per accelerator hour). Compute itself is the same in every
    scenario, so it is left out: what differs is what the data path costs."""
    wan = wan_bytes / 1e9 * price_per_gb
    idle = max(0.0, idle_s) / 3600 * gpu_hour_price
    return {"cost_wan_usd": wan, "cost_idle_usd": idle, "cost_usd": wan + idle}


def vs_local(timeline: Sequence[Batch],
             reference: Sequence[Batch] | None) -> dict[str, object]:
    """The warm-up against the co-located run (``reference``; None: no such run, every
    figure None). ``warmup_batches_vs_local`` is None when the run never came within the
    margin (``warmed_up_vs_local`` False)."""
    if reference is None:
        return {"warmup_batches_vs_local": None, "warmed_up_vs_local": None,
                "time_to_steady_vs_local_s": None}
    warm, warmed = warmup_vs(timeline, reference)
    return {"warmup_batches_vs_local": warm if warmed else None,
            "warmed_up_vs_local": warmed,
            "time_to_steady_vs_local_s": time_to_steady_s(timeline, warm, warmed)}


def summarize(timeline: Sequence[Batch],
              reference: Sequence[Batch] | None = None) -> dict[str, object]:
    """Every figure that comes from the timeline alone, and with ``reference`` (the
    co-located run's timeline) the warm-up measured against it (``vs_local``)."""
    warm, warmed = warmup(timeline)
    epochs = epoch_s(timeline)
    compute = sum(b.compute_s for b in timeline)
    wall = timeline[-1].t if timeline else 0.0
    return {
        "au": au(timeline),
        "au_steady": au_steady(timeline),
        "samples_per_s_steady": samples_per_s_steady(timeline),
        "stall_batches": stall_batches(timeline),
        **vs_local(timeline, reference),
        # The absolute figure (rolling AU >= 0.95), under its own name and the old one.
        "warmup_batches_au95": warm,
        "warmup_batches": warm,
        "warmed_up": warmed,
        "time_to_steady_s": time_to_steady_s(timeline, warm, warmed),
        "first_epoch_s": epochs[0] if epochs else 0.0,
        "epoch_s": epochs,
        "wall_s": wall,
        "compute_s": compute,
        "data_wait_s": sum(b.data_wait_s for b in timeline),
        "idle_s": max(0.0, wall - compute),
        "batches": len(timeline),
        "samples": sum(b.samples for b in timeline),
        "bytes_read": sum(b.bytes for b in timeline),
    }
