"""The mount's own ``/metrics`` (``spokefs mount --metrics-port``), in both engines, for real:
a hub and a spoke started here, mount processes, POSIX reads, the spoke stopped so reads fail
with EIO, and the endpoint scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.mount import sysfs
from spokefs.mount.metrics import BUCKETS, OPS
from spokefs.mount.native import unavailable
from spokefs.mount.process import MountProcess, fuse_unusable, unmount

WHY_NOT = {"python": fuse_unusable(),
           "native": fuse_unusable(need_pyfuse3=False) or unavailable()}
if os.geteuid() != 0:
    WHY_NOT = {k: v or "needs root (the mount tests' setting)" for k, v in WHY_NOT.items()}
ENGINES = [pytest.param(e, marks=pytest.mark.skipif(WHY_NOT[e] is not None,
                                                    reason=f"no {e} mount: {WHY_NOT[e]}"))
           for e in ("python", "native")]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and each family's type."""
    resp = urllib3.request("GET", url, timeout=10)
    assert resp.status == 200, resp.status
    samples: Samples = {}
    types = {}
    for fam in text_string_to_metric_families(resp.data.decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def op(samples: Samples, kind: str, suffix: str = "count", le: str | None = None) -> float:
    labels = (("le", le), ("op", kind)) if le is not None else (("op", kind),)
    return samples.get((f"spokefs_mount_op_seconds_{suffix}", labels), 0.0)


def total(samples: Samples, name: str) -> float:
    return samples.get((name, ()), 0.0)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    if all(WHY_NOT.values()):
        pytest.skip(f"no mount: {WHY_NOT}")
    root = tmp_path_factory.mktemp("metricsstack")
    ds = make_dataset(root / "ds", n_small=16, big_sizes=(3_000_000,))
    with hub(ds, root / "hubstate") as h:
        yield ds, h


def _ready_url(line: str) -> str:
    m = re.search(r"metrics=(http://127\.0\.0\.1:\d+/metrics)", line)
    assert m, line
    return m.group(1)


@pytest.mark.timing
@pytest.mark.mount
@pytest.mark.parametrize("engine", ENGINES)
def test_metrics_count_reads_latency_and_eio(source: tuple[Path, ServerProcess],
                                             tmp_path: Path, engine: str) -> None:
    ds, h = source
    s = spoke(h.url, tmp_path / "cache", "1GiB").start()  # ours: it is stopped below
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        # Over HTTP only: a block the spoke prefetched cannot then be read from its files
        # once it is down, so the read below fails for certain.
        with MountProcess(f"{s.url}/ds", mp, "--engine", engine, "--deadline", "2s",
                          "--no-short-circuit", "--metrics-port", "0") as m:
            assert m.ready_line is not None and f"engine={engine}" in m.ready_line
            url = _ready_url(m.ready_line)
            before, types = scrape(url)
            assert types["spokefs_mount_op_seconds"] == "histogram"
            assert types["spokefs_mount_eio"] == types["spokefs_mount_read_bytes"] == "counter"
            assert types["spokefs_mount_info"] == "gauge"  # an Info, in text format 0.0.4
            info = next(dict(k[1]) for k in before if k[0] == "spokefs_mount_info")
            assert info["engine"] == engine and info["mountpoint"] == str(mp.absolute())

            names = sorted(os.listdir(mp / "class1"))
            assert len(names) == 4
            files = [mp / "class1" / n for n in names] + [mp / "shards" / "shard-000.tar"]
            read = 0
            for f in files:
                got = f.read_bytes()
                assert got == (ds / f.relative_to(mp)).read_bytes()
                read += len(got)
            after, _ = scrape(url)

            # Every byte handed to the kernel once (a fresh mount: no page was cached).
            assert total(after, "spokefs_mount_read_bytes_total") - \
                total(before, "spokefs_mount_read_bytes_total") == read
            reads = op(after, "read") - op(before, "read")
            # At least one request a file, at most one a page (plus one at EOF each).
            assert len(files) <= reads <= read // 4096 + 2 * len(files), reads
            assert op(after, "read", "sum") > op(before, "read", "sum")
            assert op(after, "open") - op(before, "open") == len(files)  # one OPEN an open()
            # class1, shards, shard-000.tar (the listing gave the kernel the rest)
            assert op(after, "lookup") - op(before, "lookup") >= 3
            assert op(after, "opendir") - op(before, "opendir") >= 1
            assert op(after, "readdir") - op(before, "readdir") >= 1
            for kind in OPS:  # cumulative buckets, the bounds both engines share
                counts = [op(after, kind, "bucket", floatToGoString(b)) for b in BUCKETS]
                les = sorted({float(dict(k[1])["le"]) for k in after
                              if k[0] == "spokefs_mount_op_seconds_bucket"
                              and dict(k[1])["op"] == kind})
                assert les == [*BUCKETS, float("inf")], (kind, les)
                assert counts == sorted(counts), (kind, counts)
                assert op(after, kind, "bucket", "+Inf") == op(after, kind)
            assert total(after, "spokefs_mount_eio_total") == 0

            s.stop()  # the spoke goes away: a file not read yet cannot be answered
            t0 = time.monotonic()
            with pytest.raises(OSError) as exc:
                (mp / "class2" / "img0002.jpg").read_bytes()
            assert exc.value.errno == errno.EIO
            assert time.monotonic() - t0 >= 1.5  # the deadline, not a quick refusal
            failed, _ = scrape(url)
            eio = total(failed, "spokefs_mount_eio_total")
            # The kernel may ask once more for a page after a failed read: one or two.
            assert 1 <= eio <= 2, eio
            assert op(failed, "read") - op(after, "read") >= eio
            # Each EIO waited out the 2 s deadline: past the 1.05 s bucket.
            slow = lambda x: op(x, "read") - op(x, "read", "bucket", "1.048576")  # noqa: E731
            assert slow(failed) - slow(after) >= eio
            assert total(failed, "spokefs_mount_read_bytes_total") == \
                total(after, "spokefs_mount_read_bytes_total")
        final = [x for x in m.output if "unmounted" in x]
        assert final and re.search(rf"\b{int(eio)} failed", final[-1]), m.output
    finally:
        s.stop()


def test_the_metrics_flags_go_through_the_config_model(
        source: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "mount", f"{source[1].url}/ds",
                        str(mp), "--metrics-port", "70000"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "--metrics-port 70000" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "mount", f"{source[1].url}/ds",
                        str(mp), "--print-config"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SPOKEFS_MOUNT_METRICS_PORT": "9109"})
    assert r.returncode == 0, r.stderr
    port = next(x for x in r.stdout.splitlines() if "metrics_port" in x)
    assert "= 9109" in port and "# env SPOKEFS_MOUNT_METRICS_PORT" in port, r.stdout
    addr = next(x for x in r.stdout.splitlines() if "metrics_addr" in x)
    assert "127.0.0.1" in addr and "default" in addr, r.stdout


@pytest.mark.mount
@pytest.mark.parametrize("engine", ENGINES)
def test_a_background_mount_serves_metrics_set_by_env_or_file(
        source: tuple[Path, ServerProcess], tmp_path: Path, engine: str) -> None:
    """The detached child re-runs the whole command line, so the setting reaches it however
    it was given: the environment for one engine, a --config file for the other."""
    ds, h = source
    mp = tmp_path / "mnt"
    mp.mkdir()
    env = dict(os.environ)
    extra: list[str] = []
    if engine == "native":
        env["SPOKEFS_MOUNT_METRICS_PORT"] = "0"
    else:
        conf = tmp_path / "spokefs.toml"
        conf.write_text("[mount]\nmetrics_port = 0\n")
        extra = ["--config", str(conf)]
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "mount", f"{h.url}/ds", str(mp),
                        "--engine", engine, "--log-file", str(tmp_path / "m.log"), *extra],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    pid = int(re.search(r"\(pid (\d+), log ", r.stdout).group(1))  # type: ignore[union-attr]
    try:
        url = _ready_url(r.stdout)
        before, _ = scrape(url)
        data = (mp / "class0" / "img0000.jpg").read_bytes()
        assert data == (ds / "class0" / "img0000.jpg").read_bytes()
        after, _ = scrape(url)
        assert total(after, "spokefs_mount_read_bytes_total") - \
            total(before, "spokefs_mount_read_bytes_total") == len(data)
        assert op(after, "read") > op(before, "read")
    finally:
        subprocess.run([sys.executable, "-m", "spokefs.cli", "umount", str(mp)],
                       capture_output=True, timeout=60)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
        if sysfs.is_mounted(mp):
            unmount(mp)
    with pytest.raises(urllib3.exceptions.HTTPError):  # gone with its mount
        urllib3.request("GET", url, timeout=2, retries=False)
