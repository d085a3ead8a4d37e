"""Figures for the training benchmark (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spokefs_bench.training.metrics import LOCAL_MARGIN, STEADY_AU, WINDOW, Batch, walls

SMOOTH = 5  # batches in the plotted moving window (centred): sharp enough to show phases


def smoothed(timeline: Sequence[Batch], half: int = SMOOTH // 2) -> tuple[list[float],
                                                                        list[float]]:
    """(samples/s, AU) at each batch over the batches within ``half`` of it (sums of
    samples and compute over the sum of wall times, so one long wait is not averaged away)."""
    w = walls(timeline)
    rate, util = [], []
    for i in range(len(timeline)):
        lo, hi = max(0, i - half), min(len(timeline), i + half + 1)
        wall = sum(w[lo:hi])
        rate.append(sum(b.samples for b in timeline[lo:hi]) / wall if wall > 0 else 0.0)
        util.append(min(1.0, sum(b.compute_s for b in timeline[lo:hi]) / wall)
                    if wall > 0 else 0.0)
    return rate, util


def warmup_of(r: dict[str, Any]) -> tuple[int, bool, float | None]:
    """(warm-up batches, warmed up, seconds to steady) against local when the run had one,
    else the absolute figure (rolling AU >= 0.95)."""
    if r.get("warmed_up_vs_local") is not None:
        return (r.get("warmup_batches_vs_local") or 0, bool(r["warmed_up_vs_local"]),
                r.get("time_to_steady_vs_local_s"))
    return r.get("warmup_batches", 0), bool(r.get("warmed_up")), r.get("time_to_steady_s")


def plot_timelines(path: Path, timelines: dict[str, list[Batch]],
                   results: dict[str, dict[str, Any]], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_au) = plt.subplots(2, 1, figsize=(12, 8.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    longest = max(timelines.values(), key=len)
    for k, (name, tl) in enumerate(timelines.items()):
        if not tl:
            continue
        c = colors[k % len(colors)]
        rate, util = smoothed(tl)
        ax_rate.plot(range(len(tl)), rate, color=c, lw=1.3, label=name)
        ax_au.plot(range(len(tl)), util, color=c, lw=1.3, label=name)
        r = results.get(name, {})
        w, warmed, _ = warmup_of(r)
        if warmed and w:
            ax_au.axvline(w, color=c, ls=":", lw=1.2)
            ax_au.annotate(f"{name}: {w}", (w, 0.02 + 0.045 * (k % 13)), color=c, fontsize=7,
                           xytext=(3, 0), textcoords="offset points")
        elif not warmed:
            ax_au.annotate(f"{name}: never steady", (len(tl) - 1, util[-1]), color=c,
                           fontsize=7, ha="right", xytext=(0, 4), textcoords="offset points")
    # Epochs are the same batches in every scenario (same data, same loop).
    starts = [i for i in range(len(longest)) if i == 0 or
              longest[i].epoch != longest[i - 1].epoch] + [len(longest)]
    for ax in (ax_rate, ax_au):
        for b in starts[1:-1]:
            ax.axvline(b, color="0.4", ls="--", lw=0.8)
        if len(starts) > 2:
            ax.axvspan(0, starts[1], color="0.9", zorder=0)
            ax.axvspan(starts[-2], starts[-1], color="#e4f2e4", zorder=0)
        ax.grid(alpha=0.3)
    n_epochs = len(starts) - 1
    for e in range(n_epochs):
        label = ("epoch 1: cold" if e == 0 else
                 f"epoch {e + 1}: steady figures" if e == n_epochs - 1 else f"epoch {e + 1}")
        ax_rate.text((starts[e] + starts[e + 1]) / 2, 1.01, label, ha="center", va="bottom",
                     fontsize=8, color="0.3", transform=ax_rate.get_xaxis_transform())
    ax_au.axhline(STEADY_AU, color="k", lw=0.6)
    ax_au.set_ylim(0, 1.05)
    ax_rate.set_ylabel(f"samples/s ({SMOOTH}-batch moving window)")
    ax_au.set_ylabel(f"accelerator utilisation ({SMOOTH}-batch window)")
    ax_au.set_xlabel(f"batch   (dashed: epoch boundaries; dotted: warm-up, the first batch "
                     f"from which every {WINDOW}-batch window's AU is within {LOCAL_MARGIN} of "
                     f"local's; black: AU {STEADY_AU})")
    ax_rate.legend(fontsize=8, ncol=2, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(path: Path, results: dict[str, dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    steady = [warmup_of(results[n])[2] for n in names]
    walls = [results[n]["wall_s"] for n in names]
    heights = [s if s is not None else w for s, w in zip(steady, walls, strict=True)]
    bars = axes[0].bar(names, heights, color="tab:blue")
    for b, s in zip(bars, steady, strict=True):
        if s is None:  # never steady: the whole run, hatched
            b.set_hatch("//")
            b.set_facecolor("0.8")
    axes[0].set_title("time to local's pace (s)\nhatched: never, whole run shown",
                      fontsize=9)
    data_bytes = results[names[0]]["dataset_bytes"] if names else 0
    axes[1].bar(names, [results[n]["wan_bytes"] / 1e6 for n in names], color="tab:orange")
    if data_bytes:
        axes[1].axhline(data_bytes / 1e6, color="k", lw=0.8, ls="--")
    axes[1].set_title("bytes over the link (MB)\ndashed: the dataset", fontsize=9)
    axes[2].bar(names, [results[n]["cost_wan_usd"] for n in names], label="link")
    axes[2].bar(names, [results[n]["cost_idle_usd"] for n in names],
                bottom=[results[n]["cost_wan_usd"] for n in names], label="idle accelerator")
    axes[2].set_title("cost of the run ($)", fontsize=9)
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", rotation=40, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_ha("right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
