"""Real hub, spoke and link processes for tests: started with the CLI, port 0, ready line."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"^spokefs (\w+) listening on (\S+)(?: control (\S+))?")


class ServerProcess:
    """A ``spokefs ...`` service in its own process; ``url`` once its ready line is printed."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "spokefs.cli", *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.control = ""
        self.output: list[str] = []

    def start(self, timeout: float = 30.0) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env, bufsize=1)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            m = READY.match(line)
            if m:
                self.url = m.group(2)
                if not self.url.startswith("http"):
                    self.url = f"http://{self.url}"
                self.control = m.group(3) or ""
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"{self.args} did not start:\n{''.join(self.output)}")
        # Keep draining output so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_dataset(root: Path, n_small: int = 20, small_size: int = 100_000,
                 big_sizes: tuple[int, ...] = (9_000_000, 4 * 1024 * 1024), seed: int = 1
                 ) -> Path:
    """A small synthetic dataset: class folders of small files and a few multi-block files."""
    rng = random.Random(seed)
    for i in range(n_small):
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img{i:04d}.jpg").write_bytes(rng.randbytes(small_size + i))
    shards = root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(big_sizes):
        (shards / f"shard-{i:03d}.tar").write_bytes(rng.randbytes(size))
    (root / "empty.txt").write_bytes(b"")
    (root / "empty_dir").mkdir(exist_ok=True)
    return root


def hub(dataset: Path, state_dir: Path, *extra: str) -> ServerProcess:
    return ServerProcess("hub", "serve", str(dataset), "--port", "0", "--state-dir",
                         str(state_dir), *extra)


def spoke(upstream: str, cache_dir: Path, cache_size: str = "1GiB", *extra: str
          ) -> ServerProcess:
    return ServerProcess("spoke", "serve", "--upstream", upstream, "--cache-dir",
                         str(cache_dir), "--cache-size", cache_size, "--port", "0",
                         "--no-fsync", *extra)
