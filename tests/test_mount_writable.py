"""``spokefs mount --writable`` (native engine; native/mount/src/writes.rs and
spokefs/mount/writes.py): files written into a writable dataset through a real FUSE mount are
uploaded to the spoke on close and fsync, published at the hub as one commit when the
folder's commit marker is renamed in (torch.distributed.checkpoint's order), and the
snapshot's own files stay read-only. Real hub, spoke and mount processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

import pytest

from spokefs.mount.process import MountError, MountProcess, fuse_unusable
from test_writeback import WRITER, Site, _published, handoffs

pytestmark = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))


def _started(tmp_path: Path) -> tuple[Site, Path]:
    """A hub and a spoke started, and an empty mountpoint."""
    site = Site(tmp_path)
    site.start_hub()
    site.start_spoke()
    assert site.spoke is not None
    mp = tmp_path / "mnt"
    mp.mkdir()
    return site, mp


def _wait_published(site: Site, want: set[str], timeout: float = 30.0) -> dict[str, str]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = _published(site)
        if want <= set(got):
            return got
        time.sleep(0.1)
    raise AssertionError(f"not published within {timeout}s: {sorted(want - set(_published(site)))}")


@pytest.mark.parametrize("way", ["handoff", "http"])
def test_a_checkpoint_written_through_the_mount_is_published_whole(tmp_path: Path, way: str
                                                                    ) -> None:
    """On the spoke's host each closed file is handed to the spoke by descriptor; without
    the short circuit (another host, as far as the mount knows) it is sent over HTTP."""
    site, mp = _started(tmp_path)
    shards = {f"__{i}_0.distcp": os.urandom(300_000 + i) for i in range(3)}
    try:
        with MountProcess(f"{site.spoke.url}/ckpt", mp, "--writable", "--engine", "native",
                          # A write token does not see where the spoke's cache is: told.
                          *(["--no-short-circuit"] if way == "http"
                            else ["--spoke-cache", str(tmp_path / "cache")]),
                          env={"SPOKEFS_TOKEN": WRITER,
                               "SPOKEFS_STAGING": str(tmp_path)}):
            # The snapshot's own files stay read-only.
            assert (mp / "old.pt").read_bytes() == b"before\n"
            for how in (lambda: os.open(mp / "old.pt", os.O_WRONLY | os.O_APPEND),
                        lambda: (mp / "old.pt").unlink()):
                with pytest.raises(OSError) as e:
                    how()
                assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
            (mp / "step-1").mkdir()
            for name, data in shards.items():
                with open(mp / "step-1" / name, "wb") as f:
                    f.write(data[:100_000])
                    f.write(data[100_000:])
                    f.flush()
                    os.fsync(f.fileno())
            # Uploaded, read back from the staging copy, listed; not yet published.
            assert (mp / "step-1" / "__1_0.distcp").read_bytes() == shards["__1_0.distcp"]
            assert sorted(os.listdir(mp / "step-1")) == sorted(shards)
            assert not any(p.startswith("step-1/") for p in _published(site))
            # A file removed before the commit is not published.
            (mp / "step-1" / "scratch").write_bytes(b"x" * 10)
            (mp / "step-1" / "scratch").unlink()
            # DCP writes its metadata under a temporary name, then renames it in.
            (mp / "step-1" / ".metadata.tmp").write_bytes(b"meta")
            os.rename(mp / "step-1" / ".metadata.tmp", mp / "step-1" / ".metadata")
            got = _wait_published(site, {f"step-1/{n}" for n in [*shards, ".metadata"]})
            # Each close with new bytes and the rename, by descriptor or all over HTTP: the
            # shards, the scratch file, .metadata.tmp, then .metadata.
            assert handoffs(site) == (len(shards) + 3 if way == "handoff" else 0)
            assert not {"step-1/.metadata.tmp", "step-1/scratch"} & set(got)
            # Published: its staging copy is gone; it is read from a newer snapshot.
            with pytest.raises(OSError) as e:
                (mp / "step-1" / "__0_0.distcp").read_bytes()
            assert e.value.errno == errno.ESTALE
            with pytest.raises(OSError) as e:
                os.open(mp / "step-1" / "__0_0.distcp", os.O_RDWR)
            assert e.value.errno == errno.EROFS
        for name, data in shards.items():
            assert (site.ckpt / "step-1" / name).read_bytes() == data
        assert (site.ckpt / "step-1" / ".metadata").read_bytes() == b"meta"
        assert not list(tmp_path.glob("spokefs-mount-*")), "staging left behind"
    finally:
        site.close()


def test_writable_needs_a_writable_dataset(tmp_path: Path) -> None:
    site, mp = _started(tmp_path)
    try:
        with pytest.raises(MountError, match="--writable: dataset 'ro' is read-only"), \
                MountProcess(f"{site.spoke.url}/ro", mp, "--writable",
                             env={"SPOKEFS_TOKEN": WRITER}):
            pass
    finally:
        site.close()


def test_a_mount_killed_mid_save_loses_no_closed_file(tmp_path: Path) -> None:
    """kill -9 of the mount after two ranks closed their shards, before the commit marker:
    nothing of the checkpoint is published (no half checkpoint), the two closed shards are
    held at the spoke as written (close returned: acknowledged), and a commit sent later
    publishes them whole."""
    from spokefs.mount import sysfs
    from spokefs.mount.process import unmount

    site, mp = _started(tmp_path)
    shards = {f"__{i}_0.distcp": os.urandom(200_000 + i) for i in range(2)}
    m = MountProcess(f"{site.spoke.url}/ckpt", mp, "--writable", "--engine", "native",
                     env={"SPOKEFS_TOKEN": WRITER, "SPOKEFS_STAGING": str(tmp_path)})
    try:
        m.start()
        (mp / "step-1").mkdir()
        for name, data in shards.items():
            with open(mp / "step-1" / name, "wb") as f:
                f.write(data)
        busy = os.open(mp / "step-1" / "__2_0.distcp", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(busy, b"half")  # a rank mid-write when the mount dies
        m.kill()
        with contextlib.suppress(OSError):  # ENOTCONN: the session is gone
            os.close(busy)
    finally:
        m.kill()
        if sysfs.is_mounted(mp):
            unmount(mp)
    try:
        left = list(tmp_path.glob("spokefs-mount-*"))
        assert len(left) == 1  # kill -9: no clean-up ran
        # The next writable mount on this node removes the dead one's staging folder, and
        # keeps its own while it runs.
        with MountProcess(f"{site.spoke.url}/ckpt", mp, "--writable", "--engine", "native",
                          env={"SPOKEFS_TOKEN": WRITER, "SPOKEFS_STAGING": str(tmp_path)}):
            now = list(tmp_path.glob("spokefs-mount-*"))
            assert left[0] not in now and len(now) == 1
        assert not list(tmp_path.glob("spokefs-mount-*"))
        assert not any(p.startswith("step-1/") for p in _published(site))
        up = site.writer()
        held = {u["path"]: u for u in up.writeback()["uploads"]}
        assert sorted(held) == sorted(f"step-1/{n}" for n in shards)
        assert all(u["whole"] for u in held.values())
        up.commit(prefix="step-1/")
        assert up.wait_safe("step-1/", timeout=30)
        for name, data in shards.items():
            assert (site.ckpt / "step-1" / name).read_bytes() == data
        assert not (site.ckpt / "step-1" / "__2_0.distcp").exists()
    finally:
        site.close()


def _passthrough_offered() -> bool:
    """FUSE passthrough with multigrain timestamps: Linux 6.13 or later, a mount by root."""
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    return os.geteuid() == 0 and release >= (6, 13)


@pytest.mark.parametrize("passthrough", ["auto", "off"])
def test_a_change_right_after_an_fsync_is_uploaded_at_close(tmp_path: Path, passthrough: str
                                                            ) -> None:
    """A close uploads what changed since the fsync's upload, a same-size overwrite made
    microseconds later included: in passthrough the kernel writes the staging file and the
    mount knows the change only by that file's stamp (its ctime). The log says which way
    the writes went."""
    site, mp = _started(tmp_path)
    first, second = os.urandom(300_000), os.urandom(300_000)
    try:
        with MountProcess(f"{site.spoke.url}/ckpt", mp, "--writable", "--engine", "native",
                          "--write-passthrough", passthrough,
                          "--spoke-cache", str(tmp_path / "cache"),
                          env={"SPOKEFS_TOKEN": WRITER,
                               "SPOKEFS_STAGING": str(tmp_path)}) as m:
            (mp / "s").mkdir()
            fd = os.open(mp / "s" / "a.distcp", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, first)
                os.fsync(fd)                # uploaded: the spoke holds `first`
                held = {u["path"]: u for u in site.writer().writeback()["uploads"]}
                assert held["s/a.distcp"]["whole"] and held["s/a.distcp"]["size"] == len(first)
                os.pwrite(fd, second, 0)    # then overwritten, the size unchanged
            finally:
                os.close(fd)                # uploaded again
            assert (mp / "s" / "a.distcp").read_bytes() == second
            (mp / "s" / ".metadata").write_bytes(b"meta")
            _wait_published(site, {"s/a.distcp", "s/.metadata"})
            said = "".join(m.output)
        assert (site.ckpt / "s" / "a.distcp").read_bytes() == second
        assert ("writes new files to their staging files itself" in said) == (
            passthrough == "auto" and _passthrough_offered()), said
    finally:
        site.close()
