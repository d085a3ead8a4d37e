"""Talking to a spoke's control routes from plain Python: orders, epochs, warm-up, residency.

    from spokefs.client.control import SpokeControl
    ctl = SpokeControl("http://spoke:8471/imagenet", job="resnet-run-7")
    ctl.announce(epoch, paths_in_the_order_they_will_be_read)
    ctl.warm(prefix="train", wait=True)          # progress bar; returns when resident
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from spokefs.client.sync import Client
from spokefs.client.urls import parse_url


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

    def warm(self, paths: Sequence[str] | None = None, prefix: str | None = None,
             pin: bool = False, wait: bool = False, progress: bool = True,
             timeout: float | None = None, poll: float = 0.5) -> dict[str, Any]:
        """Fill the spoke with these files; with ``wait``, block until they are resident."""
        doc = self._select(paths, None, prefix)
        doc["pin"] = pin
        started = self._post(f"/v1/datasets/{self.dataset}/warm", doc)
        self.snapshot = started["snapshot"]  # poll the snapshot that is being warmed
        if not wait:
            return started
        end = None if timeout is None else time.monotonic() + timeout
        with tqdm(total=started["bytes"], unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"warming {started['files']} files", disable=not progress) as bar:
            while True:
                r = self.residency(paths, prefix)
                bar.update(r["resident_bytes"] - bar.n)
                bar.set_postfix(files=f"{r['resident_files']}/{r['files']}")
                if r["resident_bytes"] >= r["bytes"]:
                    return r
                if end is not None and time.monotonic() > end:
                    raise TimeoutError(f"warm-up not done after {timeout}s: "
                                       f"{r['fraction']:.1%} resident")
                time.sleep(poll)
