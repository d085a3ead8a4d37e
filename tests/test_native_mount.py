"""The native mount engine (``spokefs mount --engine native``: the Rust FUSE daemon in
native/mount, ``spokefs._native.Mount``), for real: hub and spoke processes, mount processes,
POSIX reads, the spoke's cache files damaged on disk, the spoke stopped and restarted.

The engine's pieces have Rust unit tests (``cargo test -p spokefs-mount`` in native/); these
tests check the whole against the Python mount's contract (tests/test_mount.py runs the same
contract with the default engine).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, hub, make_dataset, metric, spoke
from spokefs.cache.inspect import blocks_on_disk
from spokefs.errors import ConfigError
from spokefs.mount import sysfs
from spokefs.mount.native import choose, unavailable
from spokefs.mount.process import MountProcess, fuse_unusable, unmount
from spokefs.mount.run import MountOptions

REASON = fuse_unusable(need_pyfuse3=False) or unavailable()
if REASON is None and os.geteuid() != 0:
    REASON = "needs root (the mount tests' setting: readahead, allow_other)"
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native mount: {REASON}")
NATIVE = ("--engine", "native")


# -- choosing the engine (no FUSE) ------------------------------------------------------------
def test_auto_picks_native_for_plain_http_and_python_otherwise() -> None:
    if unavailable() is not None:
        pytest.skip(f"no native mount in this build: {unavailable()}")
    mp = Path("/nonexistent")
    assert choose(MountOptions(url="http://127.0.0.1:1/ds", mountpoint=mp)) == "native"
    embedded = MountOptions(url="http://h:1/ds", mountpoint=mp, cache_dir=Path("/c"),
                            cache_size=1 << 30)
    assert choose(embedded) == "python"
    assert choose(MountOptions(url="https://h:1/ds", mountpoint=mp)) == "python"
    assert choose(MountOptions(url="http://h:1/ds", mountpoint=mp, engine="python")) == "python"
    for bad in (MountOptions(url="https://h:1/ds", mountpoint=mp, engine="native"),
                MountOptions(url="http://h:1/ds", mountpoint=mp, cache_dir=Path("/c"),
                             cache_size=1, engine="native"),
                MountOptions(url="http://h:1/ds", mountpoint=mp, engine="rust")):
        with pytest.raises(ConfigError):
            choose(bad)


# -- a real mount ------------------------------------------------------------------------------
def _build_dataset(root: Path) -> Path:
    ds = make_dataset(root, n_small=12, big_sizes=(9_000_000, 4 * 1024 * 1024, 13_000_000))
    odd = ds / "dir with space" / "caf\u00e9"
    odd.mkdir(parents=True)
    (odd / "na\u00efve \u2713.txt").write_bytes(b"unicode names work\n")
    (ds / "class0" / "img0000.jpg").chmod(0o600)
    (ds / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (ds / "run.sh").chmod(0o755)
    many = ds / "many"  # more entries than one readdir reply holds
    many.mkdir()
    for i in range(400):
        (many / f"f{i:04d}").write_bytes(b"%d" % i)
    return ds


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    if REASON is not None:
        pytest.skip(f"no native mount: {REASON}")
    root = tmp_path_factory.mktemp("nativestack")
    ds = _build_dataset(root / "ds")
    with hub(ds, root / "hubstate") as h, spoke(h.url, root / "cache", "1GiB",
                                                "--deadline", "3s") as s:
        yield ds, s


def _hub_url(stack: tuple[Path, ServerProcess]) -> str:
    s = stack[1]
    return s.args[s.args.index("--upstream") + 1]


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def _dirs(root: Path) -> set[str]:
    return {Path(d).relative_to(root).as_posix() for d, _, _ in os.walk(root)}


def _final_counts(output: str) -> dict[str, int]:
    """The counts of the mount's last log line (``unmounted ...: N reads, ...``)."""
    line = next(x for x in output.splitlines() if "unmounted" in x and "native:" in x)
    got = {k: int(v) for v, k in re.findall(
        r"(\d+) (reads|failed|from the spoke's cache files|over HTTP|short-circuit fallbacks)",
        line)}
    return got


@needs_native
@pytest.mark.mount
@pytest.mark.parametrize("way", ["short-circuit", "http"])
def test_every_file_equals_the_source(stack: tuple[Path, ServerProcess], tmp_path: Path,
                                      way: str) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    extra = ("--no-short-circuit",) if way == "http" else ()
    with MountProcess(f"{s.url}/ds", mp, *NATIVE, *extra, "--deadline", "5s") as m:
        assert "engine=native" in m.ready_line
        assert _dirs(mp) == _dirs(ds)
        assert _files(mp) == _files(ds)
        # Random pieces of a multi-block file, some past its end.
        name = "shards/shard-002.tar"
        src = (ds / name).read_bytes()
        with open(mp / name, "rb", buffering=0) as f:
            for off, n in ((0, 1), (4_194_303, 2), (5_000_000, 300_000), (12_999_999, 10),
                           (len(src), 5), (len(src) + 100, 1), (123_457, 1 << 20)):
                assert os.pread(f.fileno(), n, off) == src[off:off + n], (off, n)
    sc_on = any("short circuit on" in line for line in m.output)
    assert sc_on == (way == "short-circuit"), "".join(m.output)
    counts = _final_counts("".join(m.output))
    assert counts["failed"] == 0
    if way == "short-circuit":
        assert counts["from the spoke's cache files"] > 0
    else:
        assert counts["from the spoke's cache files"] == 0 and counts["over HTTP"] > 0
    assert not sysfs.is_mounted(mp)


@needs_native
@pytest.mark.mount
def test_listing_and_stat_equal_the_manifest(stack: tuple[Path, ServerProcess],
                                             tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    with MountProcess(f"{s.url}/ds", mp, *NATIVE):
        for dirpath, dirnames, filenames in os.walk(ds):
            rel = Path(dirpath).relative_to(ds)
            assert sorted(os.listdir(mp / rel)) == sorted(dirnames + filenames), rel
            for name in filenames:
                st_src, st = (ds / rel / name).stat(), (mp / rel / name).stat()
                assert stat.S_ISREG(st.st_mode)
                assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (
                    st_src.st_size, stat.S_IMODE(st_src.st_mode), st_src.st_mtime_ns), name
        assert len(os.listdir(mp / "many")) == 400  # several readdir replies, resumed exactly
        st = (mp / "empty_dir").stat()
        assert stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o222
        with pytest.raises(FileNotFoundError):
            (mp / "nope").stat()
        with pytest.raises(FileNotFoundError):  # twice: the negative entry is cached
            (mp / "nope").stat()
        with pytest.raises(NotADirectoryError):
            os.listdir(mp / "empty.txt")
        with pytest.raises(OSError) as info:
            open(mp / "run.sh", "r+b")  # noqa: SIM115
        assert info.value.errno == errno.EROFS
        with pytest.raises(OSError) as info:
            (mp / "new").write_bytes(b"x")
        assert info.value.errno == errno.EROFS
        vfs = os.statvfs(mp)
        assert vfs.f_bfree == 0 and vfs.f_blocks * vfs.f_frsize >= sum(
            len(b) for b in _files(ds).values())
        entry = sysfs.mount_entry(mp)
        assert entry is not None and entry[1] == "fuse.spokefs"
        options = next(line.split()[5].split(",")
                       for line in Path("/proc/self/mountinfo").read_text().splitlines()
                       if line.split()[4] == str(mp))
        assert {"ro", "nosuid", "nodev"} <= set(options), options
        ra = sysfs.read_ahead_path(mp)
        if ra is not None:
            assert int(ra.read_text()) == 4096


@needs_native
@pytest.mark.mount
def test_a_damaged_cached_block_is_never_served(stack: tuple[Path, ServerProcess],
                                                tmp_path: Path) -> None:
    import urllib3

    ds = stack[0]
    mp = tmp_path / "mnt"
    mp.mkdir()
    name = "shards/shard-000.tar"
    src = (ds / name).read_bytes()
    with spoke(_hub_url(stack), tmp_path / "cache", "1GiB") as s:
        assert urllib3.request("GET", f"{s.url}/ds/{name}").data == src  # resident now
        end = time.monotonic() + 10
        while len(blocks_on_disk(tmp_path / "cache")) < 3 and time.monotonic() < end:
            time.sleep(0.02)  # the index is committed in batches
        for b in blocks_on_disk(tmp_path / "cache"):  # flip a byte in every block
            with open(b.path, "r+b") as f:
                at = b.offset + b.size // 3
                byte = os.pread(f.fileno(), 1, at)
                os.pwrite(f.fileno(), bytes([byte[0] ^ 0x55]), at)
        with MountProcess(f"{s.url}/ds", mp, *NATIVE) as m:
            assert any("short circuit on" in line for line in m.output)
            assert (mp / name).read_bytes() == src  # detected, read over HTTP, never served
        assert metric(s.url, "spokefs_integrity_failures_total") >= 1
    counts = _final_counts("".join(m.output))
    assert counts["short-circuit fallbacks"] >= 1 and counts["over HTTP"] >= 1, counts
    assert counts["failed"] == 0


@pytest.mark.timing
@needs_native
@pytest.mark.mount
def test_spoke_down_gives_eio_within_the_deadline_then_recovers(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds = stack[0]
    cache = tmp_path / "cache"
    s = spoke(_hub_url(stack), cache, "1GiB").start()
    mp = tmp_path / "mnt"
    mp.mkdir()
    name, other = "shards/shard-002.tar", "class3/img0003.jpg"
    src = (ds / name).read_bytes()
    try:
        with MountProcess(f"{s.url}/ds", mp, *NATIVE, "--deadline", "2s") as m, \
                open(mp / name, "rb", buffering=0) as f:
            assert os.pread(f.fileno(), 4096, 0) == src[:4096]  # mid-read...
            s.stop()  # ...the spoke goes away
            for what, fd_read in (
                    ("the rest of an open file", lambda: os.pread(f.fileno(), 65536, 9 << 20)),
                    ("a file not read yet", lambda: (mp / other).read_bytes())):
                t0 = time.monotonic()
                with pytest.raises(OSError) as info:
                    fd_read()
                elapsed = time.monotonic() - t0
                assert info.value.errno == errno.EIO, what
                # The deadline, not before (less one backoff step); the kernel may ask again
                # for one page after a failed read: up to two deadlines, plus room for load.
                assert 1.5 <= elapsed < 8.0, (what, elapsed)
            assert m.alive()
            s = spoke(_hub_url(stack), cache, "1GiB", "--port", str(s.port)).start()
            assert os.pread(f.fileno(), 65536, 9 << 20) == src[9 << 20:(9 << 20) + 65536]
            assert (mp / other).read_bytes() == (ds / other).read_bytes()
        out = "".join(m.output)
        assert "answering EIO" in out and "unavailable for 2s" in out, out
    finally:
        s.stop()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spokefs.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@needs_native
@pytest.mark.mount
def test_background_mount_then_spokefs_umount_leaves_no_mount(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = _cli("mount", f"{s.url}/ds", str(mp), *NATIVE, "--log-file", str(tmp_path / "m.log"))
    assert r.returncode == 0, r.stderr
    m = re.search(r"engine=native.*\(pid (\d+), log ", r.stdout)
    assert m, r.stdout
    pid = int(m.group(1))
    try:
        assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()
        r = _cli("umount", str(mp))
        assert r.returncode == 0, r.stderr
        assert not sysfs.is_mounted(mp) and os.listdir(mp) == []
        assert _wait_gone(pid), "the mount process outlived its mount"
        log = (tmp_path / "m.log").read_text()
        assert "engine: native" in log and "unmounted" in log, log
    finally:
        if not _wait_gone(pid, 0.1):
            os.kill(pid, signal.SIGKILL)
        if sysfs.is_mounted(mp):
            unmount(mp)


@needs_native
@pytest.mark.mount
def test_sigterm_unmounts_even_with_a_file_open(stack: tuple[Path, ServerProcess],
                                                tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    m = MountProcess(f"{s.url}/ds", mp, *NATIVE).start()
    try:
        assert m.proc is not None
        busy = os.open(mp / "shards" / "shard-001.tar", os.O_RDONLY)
        try:
            assert os.read(busy, 10) == (ds / "shards" / "shard-001.tar").read_bytes()[:10]
            m.proc.send_signal(signal.SIGTERM)
            assert m.proc.wait(15) == 0
            assert not sysfs.is_mounted(mp)  # detached lazily: a busy reader cannot block it
        finally:
            # The session ended with its process: the kernel answers the close's flush
            # with ENOTCONN (the descriptor is released all the same).
            with contextlib.suppress(OSError):
                os.close(busy)
        m2 = MountProcess(f"{s.url}/ds", mp, *NATIVE).start()  # the mountpoint is free again
        assert m2.proc is not None
        m2.proc.send_signal(signal.SIGINT)  # Ctrl-C unmounts too
        assert m2.proc.wait(15) == 0
        assert not sysfs.is_mounted(mp)
    finally:
        m.kill()
        if sysfs.is_mounted(mp):
            unmount(mp)


@needs_native
@pytest.mark.mount
def test_owner_and_modes_show_in_stat(stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    """--uid, --gid, --file-mode, --dir-mode (and -o) in the native engine, as in the python
    one (tests/test_mount.py)."""
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()

    def check(uid: int, gid: int, file_mode: int | None, dir_mode: int) -> int:
        n = 0
        for dirpath, _, filenames in os.walk(mp):
            st = os.stat(dirpath)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, dir_mode)
            for name in filenames:
                p = Path(dirpath) / name
                st = p.stat()
                want = file_mode if file_mode is not None else stat.S_IMODE(
                    (ds / p.relative_to(mp)).stat().st_mode)
                assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, want), p
                n += 1
        return n

    with MountProcess(f"{s.url}/ds", mp, *NATIVE, "--uid", "1234", "--gid", "2345",
                      "--file-mode", "0640", "--dir-mode", "0750") as m:
        assert "engine=native" in m.ready_line
        assert check(1234, 2345, 0o640, 0o750) > 400
        assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()
    with MountProcess(f"{s.url}/ds", mp, *NATIVE, "-o", "uid=77,file_mode=0400,noexec"):
        check(77, os.getgid(), 0o400, 0o555)
    with MountProcess(f"{s.url}/ds", mp, *NATIVE):  # the defaults
        check(os.getuid(), os.getgid(), None, 0o555)
