"""A spoke with several worker processes: one cache, one fetch per block, restarts."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import urllib3

from servers import metric, output_with, spoke
from spokefs.client.control import SpokeControl

http = urllib3.PoolManager(retries=False, maxsize=32, timeout=60)


def files(dataset: Path) -> dict[str, bytes]:
    return {p.relative_to(dataset).as_posix(): p.read_bytes()
            for p in sorted(dataset.rglob("*")) if p.is_file()}


def read_everything(base: str, want: dict[str, bytes], connections: int = 16) -> None:
    """Read every file over many connections (so every worker serves some)."""
    errors: list[str] = []
    paths = list(want)

    def reader(k: int) -> None:
        pool = urllib3.HTTPConnectionPool(base.split("//")[1].split(":")[0],
                                          int(base.rsplit(":", 1)[1]), maxsize=1, retries=False)
        for p in paths[k::connections]:
            r = pool.request("GET", f"/ds/{p}")
            if r.status != 200 or r.data != want[p]:
                errors.append(f"{p}: HTTP {r.status}, {len(r.data)} bytes")
        pool.close()

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


def workers_of(supervisor: int) -> dict[str, list[int]]:
    """PIDs of a supervisor's worker processes, by role."""
    out: dict[str, list[int]] = {"primary": [], "replica": []}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == supervisor and b"_worker" in cmd:
            out[cmd[cmd.index(b"--role") + 1].decode()].append(int(d))
    return out


def wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def test_workers_share_one_cache_and_fetch_each_block_once(hub_server, dataset: Path,
                                                          tmp_path: Path) -> None:
    want = files(dataset)
    total = sum(len(v) for v in want.values())
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--workers", "3") as s:
        assert "(3 workers)" in "".join(s.output)
        big = "shards/shard-000.tar"
        results: list[bytes] = []

        def one() -> None:  # many readers of one uncached file, on many connections
            results.append(urllib3.PoolManager(retries=False).request(
                "GET", f"{s.url}/ds/{big}").data)

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r == want[big] for r in results)
        read_everything(s.url, want)
        assert metric(s.url, "spokefs_upstream_bytes_total") == total  # each block once
        misses = metric(s.url, "spokefs_cache_misses_total")
        read_everything(s.url, want)  # warm: every worker serves from the shared cache
        assert metric(s.url, "spokefs_upstream_bytes_total") == total
        assert metric(s.url, "spokefs_cache_misses_total") == misses
        assert metric(s.url, "spokefs_cache_hits_total") >= len(want)
        served = metric(s.url, "spokefs_served_bytes_total")
        assert served >= 2 * total  # what every worker sent, counted in one place


def test_control_routes_answer_through_any_worker(hub_server, dataset: Path,
                                                  tmp_path: Path) -> None:
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--workers", "2") as s:
        for _ in range(6):  # new connections land on either worker
            ctl = SpokeControl(f"{s.url}/ds")
            assert ctl.residency(prefix="")["files"] == len(files(dataset))
        SpokeControl(f"{s.url}/ds").warm(prefix="", wait=True, progress=False, timeout=60,
                                         poll=0.05)
        r = http.request("POST", f"{s.url}/v1/purge", body=b"{}",
                         headers={"Content-Type": "application/json"})
        assert r.status == 200
        assert SpokeControl(f"{s.url}/ds").residency(prefix="")["resident_bytes"] == 0


def test_a_killed_worker_is_restarted_and_reads_go_on(hub_server, dataset: Path,
                                                      tmp_path: Path) -> None:
    want = files(dataset)
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--workers", "2") as s:
        assert s.proc is not None
        read_everything(s.url, want)
        before = workers_of(s.proc.pid)
        assert len(before["primary"]) == 1 and len(before["replica"]) == 1
        for role in ("replica", "primary"):
            os.kill(workers_of(s.proc.pid)[role][0], signal.SIGKILL)
            wait_for(lambda r=role: workers_of(s.proc.pid)[r]
                     and workers_of(s.proc.pid)[r] != before[r], 30, f"a new {role}")
            read_everything(s.url, want)  # from the cache the restarted primary reopened
        assert metric(s.url, "spokefs_upstream_bytes_total") == 0  # nothing fetched again
        assert "exited with -9; restarting" in output_with(s, "exited with -9; restarting")
    for pid in [*before["primary"], *before["replica"]]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_killing_the_spoke_kills_its_workers(hub_server, tmp_path: Path) -> None:
    s = spoke(hub_server.url, tmp_path / "cache", "1GiB", "--workers", "2").start()
    assert s.proc is not None
    pids = [*workers_of(s.proc.pid)["primary"], *workers_of(s.proc.pid)["replica"]]
    assert len(pids) == 2
    s.kill()  # SIGKILL: no chance to stop them itself

    def gone() -> bool:
        return all(not Path(f"/proc/{p}").exists()
                   or Path(f"/proc/{p}/stat").read_text().split(")")[1].split()[0] == "Z"
                   for p in pids)

    wait_for(gone, 10, "the workers to die with their supervisor")


def test_a_deep_cache_folder_serves_with_workers(hub_server, dataset: Path, tmp_path: Path
                                                 ) -> None:
    """The workers' unix sockets live in the cache folder; one deeper than a socket path
    may be long (108 bytes) still works (the kernel is given a short alias of the path)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "cache"
    assert len(str(deep / "worker-1.sock")) > 108
    with spoke(hub_server.url, deep, "256MiB", "--workers", "2") as s:
        for p in sorted(dataset.rglob("*.jpg"))[:8]:
            rel = p.relative_to(dataset).as_posix()
            assert http.request("GET", f"{s.url}/ds/{rel}").data == p.read_bytes()
        assert metric(s.url, "spokefs_served_bytes_total") > 0  # the replica reported too
