"""``spokefs warm`` for scripts, against real hub and spoke processes: an exit status for
every outcome (resident, blocks failed and named, a set too large, a timeout), ``--check``
for residency, and the Python API's exceptions behind them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import ServerProcess, hub, make_dataset, metric, spoke
from spokefs.client.cli import EXIT_TIMEOUT, EXIT_TOO_LARGE
from spokefs.client.control import SpokeControl, WarmIncomplete

SMALL = 100_000  # bytes of each small file (make_dataset)


def warm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spokefs.cli", "warm", *args],
                          capture_output=True, text=True, timeout=timeout)


def assert_clean(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Path, ServerProcess, ServerProcess]]:
    """A dataset of 20 small files and two multi-block ones (~15 MB), a hub, and a spoke
    that gives up on its upstream after 2 s."""
    ds = make_dataset(tmp_path / "ds")
    with hub(ds, tmp_path / "hubstate") as h, \
            spoke(h.url, tmp_path / "cache", "1GiB", "--deadline", "2s") as s:
        yield ds, h, s


def test_check_before_and_after_a_warm_up(servers) -> None:
    _, _, s = servers
    before = warm(f"{s.url}/ds/class1", "--check")
    assert before.returncode == 1, before.stderr
    assert "resident: 0/5 files" in before.stdout
    assert "5 files not resident" in before.stderr and "class1/img0001.jpg" in before.stderr
    done = warm(f"{s.url}/ds/class1", "--wait")
    assert done.returncode == 0, done.stderr
    assert "resident: 5/5 files" in done.stdout
    after = warm(f"{s.url}/ds/class1", "--check")
    assert (after.returncode, after.stderr) == (0, ""), after.stderr
    assert "resident: 5/5 files" in after.stdout
    assert warm(f"{s.url}/ds", "--check").returncode == 1  # the rest is not resident


def test_without_wait_it_returns_at_once_and_check_follows(servers) -> None:
    _, _, s = servers
    r = warm(f"{s.url}/ds/class2")
    assert r.returncode == 0, r.stderr
    assert "warming 5 files" in r.stdout and "--check" in r.stdout
    end = time.monotonic() + 60
    while (c := warm(f"{s.url}/ds/class2", "--check")).returncode != 0:
        assert c.returncode == 1 and time.monotonic() < end, c.stderr
        time.sleep(0.2)
    assert "resident: 5/5 files" in c.stdout


def test_blocks_that_fail_are_named_and_the_exit_status_says_so(servers) -> None:
    ds, _, s = servers
    # Two files change at the hub under the snapshot the spoke warms: their blocks are
    # refused (410, never other bytes); the rest arrive.
    for name in ("class1/img0005.jpg", "class3/img0003.jpg"):
        (ds / name).write_bytes(os.urandom(SMALL))
    r = warm(f"{s.url}/ds", "--wait", "--timeout", "60s")
    assert_clean(r)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "resident: 21/23 files" in r.stdout
    assert "2 files not resident" in r.stderr
    assert "class1/img0005.jpg" in r.stderr and "class3/img0003.jpg" in r.stderr
    # The Python API: the same, as an exception with the files in it.
    with pytest.raises(WarmIncomplete) as exc:
        SpokeControl(f"{s.url}/ds").warm(prefix="class1", wait=True, progress=False,
                                         timeout=60)
    assert exc.value.missing.files == 1
    assert [p for p, _ in exc.value.missing.named] == ["class1/img0005.jpg"]


def test_a_hub_gone_before_the_blocks_came_names_the_first_files_and_counts_the_rest(
        servers) -> None:
    _, h, s = servers
    assert warm(f"{s.url}/ds", "--check").returncode == 1  # the spoke has the manifest
    h.stop()  # every fetch fails after the spoke's --deadline
    r = warm(f"{s.url}/ds", "--wait", "--timeout", "90s")
    assert_clean(r)
    assert r.returncode == 1, (r.stdout, r.stderr)
    # Every file but the empty one (nothing to fetch): ten named, the rest counted.
    assert "22 files not resident" in r.stderr and "and 12 more" in r.stderr
    assert "class0/img0000.jpg" in r.stderr  # the first by path


def test_a_set_larger_than_the_cache_is_refused_unless_forced(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds")  # ~15 MB
    with hub(ds, tmp_path / "hubstate") as h, \
            spoke(h.url, tmp_path / "cache", "8MiB", "--deadline", "2s") as s:
        r = warm(f"{s.url}/ds", "--wait")
        assert_clean(r)
        assert r.returncode == EXIT_TOO_LARGE, (r.stdout, r.stderr)
        assert "larger than the cache (8.0 MiB)" in r.stderr and "--force" in r.stderr
        assert metric(s.url, "spokefs_warm_blocks_total") == 0  # nothing was asked for
        small = warm(f"{s.url}/ds/class0", "--wait")  # a set that fits
        assert small.returncode == 0, small.stderr
        forced = warm(f"{s.url}/ds", "--wait", "--force", "--timeout", "60s")
        assert_clean(forced)
        assert "warning:" in forced.stderr and "larger than the cache" in forced.stderr
        # It ran: not all of it can be resident at the end.
        assert forced.returncode == 1, (forced.stdout, forced.stderr)
        assert "files not resident" in forced.stderr
        assert metric(s.url, "spokefs_warm_blocks_total") > 0


def test_a_timeout_is_a_clean_message_and_its_own_exit_status(servers) -> None:
    _, h, s = servers
    snap = SpokeControl(f"{s.url}/ds").residency(prefix="")  # the spoke knows the snapshot
    assert snap["fraction"] == 0
    os.kill(h.pid, signal.SIGSTOP)  # the hub holds every fetch: nothing arrives, none fails
    try:
        t0 = time.monotonic()
        r = warm(f"{s.url}/ds/shards", "--wait", "--timeout", "1s")
        took = time.monotonic() - t0
    finally:
        os.kill(h.pid, signal.SIGCONT)
    assert_clean(r)
    assert r.returncode == EXIT_TIMEOUT, (r.stdout, r.stderr)
    assert "not done after 1s" in r.stderr and "--check" in r.stderr
    assert took < 30
