"""The restart figure of ``spokefs bench checkpoint``: a job killed mid-epoch and restarted
on a fresh node from its last checkpoint, and the batches it takes to run at full speed
again (``resume_batches``; goal <= 3, the system this replaces needed 100-150).

The reference training loop (``spokefs_bench.training.loop``: DataLoader workers, a sleep
per batch as the accelerator) reads the built-in ``files`` dataset through a spoke over the
link, its sampler wrapped in ``spokefs.torch.AnnouncingSampler``:

1. **The job**, on a cold spoke, is killed at ``KILL_AT`` of its first epoch; its checkpoint
   holds ``sampler.state_dict(consumed=...)`` as a training script saves it with the model.
2. **The restart**, on a fresh node: another spoke with an empty cache (the harder case: a
   replaced node whose region's cache is gone too). The sampler is made again and given
   ``load_state_dict``; the rest of the epoch is announced to the spoke as it starts.
3. **The reference**: the same rest of the epoch, read from the dataset's folder on local
   disk.

``resume_batches``: the restarted run's warm-up against the reference
(``training.metrics.warmup_vs``: the first batch after which every 20-batch window's
accelerator utilisation stays within 5 points of the local run's over the same batches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spokefs.procs import Service
from spokefs_bench.dataplane import tree_cpu

KILL_AT = 0.4      # the share of the first epoch done when the job is killed
SAMPLE_SIZE = 100_000


def unavailable() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed (pip install 'spokefs[torch]')"
    return None


class _Killed(Exception):
    """The job's end: raised from its loop at the kill."""


def dataset(samples: int) -> Any:
    """The built-in ``files`` dataset of ``samples`` samples (built once, reused)."""
    from spokefs_bench.training.datasets import DatasetSpec, default_cache_dir, ensure_dataset

    return ensure_dataset(DatasetSpec("files", samples, SAMPLE_SIZE), default_cache_dir(),
                          progress=False)


def measure(data: Any, upstream: str, snapshot: str, work: Path, logs: Path
            ) -> dict[str, Any]:
    """Kill, restart on a fresh node, and the local reference (see the module's text).
    ``upstream``: the link in front of the hub that serves ``data`` as ``train-files``."""
    from spokefs.torch import AnnouncingSampler
    from spokefs_bench.training import metrics
    from spokefs_bench.training.loop import EpochSampler, LoopConfig, batches_per_epoch, run_loop
    from spokefs_bench.training.openers import FileOpener, HttpOpener
    from spokefs_bench.training.scenarios import cold_spoke

    ix, name = data.index, data.spec.name
    cfg = LoopConfig(epochs=1)
    per_epoch = batches_per_epoch(len(ix), cfg.batch_size)
    kill = max(1, int(per_epoch * KILL_AT))
    saved: dict[str, Any] = {}

    def announcing(spoke: Service, state: dict[str, Any] | None
                   ) -> Callable[[EpochSampler], Any]:
        def wrap(s: EpochSampler) -> Any:
            a = AnnouncingSampler(s, paths=ix.paths, url=f"{spoke.url}/{name}@{snapshot}",
                                  job="bench-resume")
            if state is not None:
                a.load_state_dict(state)
            saved["sampler"] = a
            return a
        return wrap

    def killed(b: Any) -> None:
        if b.index + 1 >= kill:
            # What the job's last checkpoint holds, taken at this step with the model.
            saved["state"] = saved["sampler"].state_dict(consumed=(b.index + 1) *
                                                         cfg.batch_size)
            raise _Killed

    with cold_spoke(upstream, work / "cache-job", 4 << 30, logs / "spoke-job.log") as spoke:
        opener = HttpOpener(spoke.url, name, snapshot, "the job's spoke")
        with contextlib.suppress(_Killed):
            run_loop(ix, "files", opener, cfg, data.spec.classes,
                     wrap_sampler=announcing(spoke, None), on_batch=killed)
    state = saved["state"]
    with cold_spoke(upstream, work / "cache-restart", 4 << 30,
                    logs / "spoke-restart.log") as spoke:
        opener = HttpOpener(spoke.url, name, snapshot, "a fresh node's spoke")
        restarted = run_loop(ix, "files", opener, cfg, data.spec.classes,
                             wrap_sampler=announcing(spoke, state))
        spoke_cpu = sum(tree_cpu(spoke.proc.pid)) if spoke.proc else 0.0

    class Resumed:
        """The plain sampler from the checkpoint's position (the reference reads the same
        samples in the same order)."""

        def __init__(self, s: EpochSampler) -> None:
            self.s = s

        def __iter__(self) -> Iterator[int]:
            return iter(list(self.s)[int(state["position"]):])

        def __len__(self) -> int:
            return len(self.s) - int(state["position"])

    local = run_loop(ix, "files", FileOpener(data.root, "local disk"), cfg, data.spec.classes,
                     wrap_sampler=Resumed)
    batches, warmed = metrics.warmup_vs(restarted.timeline, local.timeline)
    waits = [round(b.data_wait_s, 4) for b in restarted.timeline[:10]]
    return {"resume_batches": batches if warmed else None, "warmed_up": warmed,
            "killed_at_batch": kill, "batches_per_epoch": per_epoch,
            "resumed_at_sample": int(state["position"]),
            "batches_after_restart": len(restarted.timeline),
            "au_restarted": round(metrics.au(restarted.timeline), 3),
            "au_local": round(metrics.au(local.timeline), 3),
            "first_waits_s": waits,
            "wrong_samples": restarted.samples_wrong + local.samples_wrong,
            "restart_spoke_cpu_s": round(spoke_cpu, 3),
            "accelerator": cfg.describe_accelerator()}
