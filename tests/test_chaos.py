"""The chaos suite: faults injected into real hub, link, spoke and mount processes.

Each test runs one case of ``spokefs bench chaos`` (src/spokefs_bench/chaos.py) at CI scale:
its own processes, one fault, several readers, every byte compared with the source. The case
records each check that failed; the test shows them with the services' last log lines.
docs/reliability.md lists, per failure, what a reader sees and which setting bounds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import urllib3

from spokefs_bench.chaos import CASES, Dataset, Lab, Result, Scale, run_case

CI = Scale.ci()


def run(name: str, tmp_path: Path) -> Result:
    r = run_case(name, tmp_path, CI)
    if r.skipped:
        pytest.skip(r.outcome)
    assert not r.failures, r.explain()
    assert r.bytes_wrong == 0, r.explain()
    assert r.bytes_verified > 0, r.explain()
    return r


@pytest.mark.timeout(60)
def test_link_cut_shorter_than_the_deadline(tmp_path: Path) -> None:
    """Cached reads go on at local speed; uncached reads wait and resume by themselves; the
    multi-reader epoch ends with every byte equal to the source; retries back off."""
    r = run("link_cut", tmp_path)
    assert r.recover_s is not None
    assert r.details["slowest_cached_read_s"] < 1.0


@pytest.mark.timeout(60)
def test_link_cut_longer_than_the_deadline_is_a_clear_503(tmp_path: Path) -> None:
    """A 503 naming the upstream and the cause at the deadline, even with every upstream slot
    held by stalled prefetches; the spoke stays healthy and serves once the link is back."""
    r = run("long_cut", tmp_path)
    assert r.details["error_after_s"] <= CI.short_deadline + CI.slack


@pytest.mark.timeout(90)
def test_degraded_link_is_slower_without_errors_or_retry_storm(tmp_path: Path) -> None:
    r = run("degraded", tmp_path)
    assert r.details["upstream_requests"] <= r.details["blocks"] + 4


@pytest.mark.timeout(90)
def test_spoke_kill_9_mid_fill_keeps_verified_blocks(tmp_path: Path) -> None:
    """Restart on the same cache folder and port: index consistent, every verified block kept,
    every byte read after the restart correct, clients reconnect by themselves."""
    r = run("spoke_kill", tmp_path)
    assert r.details["kept_fraction"] == 1.0


@pytest.mark.timeout(90)
def test_hub_kill_9_and_restart_needs_no_operator(tmp_path: Path) -> None:
    run("hub_kill", tmp_path)


@pytest.mark.timeout(60)
def test_mount_cut_longer_than_its_deadline_is_eio(tmp_path: Path) -> None:
    r = run("mount_cut", tmp_path)
    # One read() may cost two deadlines: the kernel retries a failed readahead once.
    assert r.details["eio_after_s"] <= 2 * CI.short_deadline + CI.slack


@pytest.mark.timeout(90)
def test_mount_kill_9_pending_read_fails_umount_clears_remount_works(tmp_path: Path) -> None:
    run("mount_kill", tmp_path)


@pytest.mark.timeout(90)
def test_source_change_under_a_pinned_job(tmp_path: Path) -> None:
    """Old bytes or a clear 410, never another version's bytes; new readers see the change;
    stale versions are purgeable without touching the latest snapshot's blocks."""
    run("source_change", tmp_path)


@pytest.mark.timeout(90)
def test_cache_volume_full_mid_fill(tmp_path: Path) -> None:
    run("disk_full", tmp_path)


@pytest.mark.timeout(60)
def test_bit_rot_is_detected_healed_and_counted(tmp_path: Path) -> None:
    r = run("bit_rot", tmp_path)
    assert r.details["detected"] == r.details["damaged_blocks"] > 0


@pytest.mark.timeout(90)
def test_chained_spokes_middle_restarted_under_load(tmp_path: Path) -> None:
    run("chain_restart", tmp_path)


def test_every_case_has_a_test() -> None:
    here = Path(__file__).read_text()
    for name in CASES:
        assert f'run("{name}"' in here, f"case {name} has no test"


@pytest.mark.timeout(60)
def test_the_cases_run_with_tokens_as_deployed(tmp_path: Path) -> None:
    """Every case's hub and spoke run with --auth: without the lab's token a request is
    refused at each hop, with it (and through the spoke's own upstream token) it is served."""
    lab = Lab(tmp_path)
    try:
        ds = Dataset(tmp_path / "ds", CI)
        hub = lab.hub(ds, CI)
        sp = lab.spoke(hub.url, "cache")
        bare = urllib3.PoolManager(retries=False)
        for base in (hub.url, sp.url):
            assert bare.request("GET", f"{base}/ds/empty.txt").status == 401
        rel = next(p for p in ds.files if p.startswith("class"))
        r = lab.get(f"{sp.url}/ds/{rel}")
        assert r.status == 200 and r.data == ds.files[rel]
    finally:
        lab.close()
