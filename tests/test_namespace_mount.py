"""A mount of a whole namespace (``spokefs mount http://spoke/ DIR``): a folder per dataset the
token may read, each pinned to its latest snapshot when first entered.

The table's numbering and loading rules run without FUSE; the rest mounts for real, over a
hub with three datasets and a spoke, with tokens that see different datasets.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.errors import ConfigError, SpokeError
from spokefs.manifest import Manifest
from spokefs.mount import sysfs
from spokefs.mount.inodes import ROOT, InodeTable
from spokefs.mount.namespace import SHIFT, NamespaceTable
from spokefs.mount.process import MountError, MountProcess, fuse_unusable
from spokefs.mount.run import parse_pins
from spokefs.mount.source import Target

FUSE_REASON = fuse_unusable()
needs_fuse = pytest.mark.skipif(FUSE_REASON is not None, reason=f"no FUSE: {FUSE_REASON}")

ADMIN = "t-admin-" + "a" * 24
READER = "t-reader-" + "b" * 24
SPOKE = "t-spoke-" + "c" * 24


# -- without FUSE ------------------------------------------------------------------------------
def test_a_url_without_a_dataset_is_the_namespace() -> None:
    for url in ("http://hub:8470", "http://hub:8470/", "hub:8470", "spokefs://hub:8470/"):
        t = Target.parse(url)
        assert t.namespace and t.base == "http://hub:8470" and str(t) == "http://hub:8470/"
    assert not Target.parse("http://hub:8470/ds").namespace
    with pytest.raises(ConfigError, match="ftp://h/"):
        Target.parse("ftp://h/")


def test_pins_name_a_snapshot_once_per_dataset() -> None:
    assert parse_pins(["a@3fa9c1d2", "b@00ff"]) == {"a": "3fa9c1d2", "b": "00ff"}
    for bad in (["a"], ["a@latest"], ["a@1", "a@2"]):
        with pytest.raises(ConfigError):
            parse_pins(bad)
    with pytest.raises(SpokeError):
        parse_pins(["../x@1"])


def _manifest(dataset: str, paths: list[str], snapshot: str = "s1") -> Manifest:
    dirs = sorted({""} | {p.rpartition("/")[0] for p in paths if "/" in p})
    return Manifest(dataset=dataset, snapshot=snapshot, block_size=1 << 20, created=1.0,
                    paths=sorted(paths), sizes=[10 * (i + 1) for i in range(len(paths))],
                    modes=[0o100644] * len(paths), mtimes=[0] * len(paths),
                    versions=[f"{i:032x}" for i in range(len(paths))], dirs=dirs)


def test_members_keep_their_own_numbering_apart() -> None:
    t = NamespaceTable(0, pins={"b": "s7"})
    t.set_listing(["b", "a"], now=0.0)
    root_kids = list(t.children(ROOT))
    assert [t.name(i) for i in root_kids] == ["a", "b"]
    a, b = root_kids
    assert t.is_dir(a) and not t.loaded(a) and t.member(b).snapshot == "s7"  # type: ignore
    assert t.lookup(a, "x.txt") is None  # not loaded: nothing inside is known yet
    assert t.lookup(ROOT, "c") is None and t.lookup(ROOT, "../a") is None
    # A snapshot by name is its own folder, found (not listed) while its dataset is listed.
    pinned = t.lookup(ROOT, "a@0badc0de")
    assert pinned is not None and pinned not in root_kids
    assert t.lookup(ROOT, "c@0badc0de") is None

    ma = t.member(a)
    assert ma is not None
    ma.table = InodeTable(_manifest("a", ["x.txt", "sub/y.txt"]))
    x = t.lookup(a, "x.txt")
    sub = t.lookup(a, "sub")
    assert x is not None and sub is not None and x >> SHIFT == a >> SHIFT
    y = t.lookup(sub, "y.txt")
    assert y is not None and t.is_file(y) and not t.is_file(sub)
    assert t.attr(y).size == ma.table.attr(y & ((1 << SHIFT) - 1)).size
    assert t.attr(y).ino == y
    assert t.lookup(a, "..") == ROOT and t.lookup(sub, "..") == a
    assert sorted(t.name(i) for i in t.children(a)) == ["sub", "x.txt"]
    assert t.file_count == 2 and t.total_bytes == 30
    # Another member's inode numbers never meet these.
    mb = t.member(b)
    assert mb is not None
    mb.table = InodeTable(_manifest("b", ["x.txt"]))
    xb = t.lookup(b, "x.txt")
    assert xb is not None and xb != x and t.attr(xb).size == 10
    with pytest.raises(KeyError):
        t.attr((99 << SHIFT) | 1)
    # A dataset that leaves the listing stays where it was loaded (pinned for the mount).
    t.set_listing(["b"], now=1.0)
    assert [t.name(i) for i in t.children(ROOT)] == ["b"] and t.lookup(a, "x.txt") == x


# -- mounted -----------------------------------------------------------------------------------
def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _latest(base: str, dataset: str) -> str:
    r = urllib3.request("GET", f"{base}/v1/datasets/{dataset}",
                        headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status == 200, r.data
    return str(json.loads(r.data)["latest"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[dict[str, Path], ServerProcess, ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("ns")
    dirs = {name: make_dataset(root / name, n_small=6, big_sizes=(1_500_000,), seed=i)
            for i, name in enumerate(("alpha", "beta", "secret"))}
    (root / "hub.tokens").write_text(f"spoke read {SPOKE}\nadmin admin {ADMIN}\n")
    (root / "spoke.tokens").write_text(f"admin admin {ADMIN}\n"
                                       f"reader read:alpha,beta {READER}\n")
    (root / "spoke.token").write_text(SPOKE + "\n")
    with hub(dirs["alpha"], root / "hubstate", "--name", "alpha",
             "--dataset", f"beta={dirs['beta']}", "--dataset", f"secret={dirs['secret']}",
             "--auth", str(root / "hub.tokens")) as h, \
            spoke(h.url, root / "cache", "256MiB", "--auth", str(root / "spoke.tokens"),
                  "--upstream-token-file", str(root / "spoke.token"),
                  # "latest" asked on every lookup: a mount started after a new
                  # snapshot must see it, however soon after the last one it comes.
                  "--latest-ttl", "0s") as s:
        yield dirs, h, s, root


@needs_fuse
def test_the_namespace_shows_what_the_token_may_read(
        stack: tuple[dict[str, Path], ServerProcess, ServerProcess, Path],
        tmp_path: Path) -> None:
    dirs, _, s, _ = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    with MountProcess(f"{s.url}/", mp, "--deadline", "5s", env={"SPOKEFS_TOKEN": READER}):
        assert sorted(os.listdir(mp)) == ["alpha", "beta"]
        for name in ("alpha", "beta"):
            for rel in ("class0/img0000.jpg", "shards/shard-000.tar", "empty.txt"):
                assert _sha(mp / name / rel) == _sha(dirs[name] / rel), (name, rel)
            assert sorted(os.listdir(mp / name)) == sorted(os.listdir(dirs[name]))
        # A dataset the token may not read is not there, by listing nor by name.
        with pytest.raises(FileNotFoundError):
            os.stat(mp / "secret")
        with pytest.raises(FileNotFoundError):
            (mp / "secret" / "empty.txt").read_bytes()
        with pytest.raises(OSError) as exc:
            (mp / "alpha" / "new.txt").write_bytes(b"x")
        assert exc.value.errno == errno.EROFS
    assert not sysfs.is_mounted(mp)


@needs_fuse
def test_each_folder_stays_on_its_snapshot_and_pins_name_one(
        stack: tuple[dict[str, Path], ServerProcess, ServerProcess, Path],
        tmp_path: Path) -> None:
    dirs, h, s, _ = stack
    mp, mp2 = tmp_path / "mnt", tmp_path / "mnt2"
    mp.mkdir()
    mp2.mkdir()
    first = _latest(h.url, "beta")
    env = {"SPOKEFS_TOKEN": ADMIN}
    f = dirs["beta"] / "class1" / "img0001.jpg"
    old = f.read_bytes()
    with MountProcess(f"{s.url}", mp, "--deadline", "5s", env=env):
        assert (mp / "beta" / "class1" / "img0001.jpg").read_bytes() == old  # pins beta
        f.write_bytes(b"a new version of the file")
        r = urllib3.request("POST", f"{h.url}/v1/datasets/beta/snapshots",
                            headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status == 201, r.data
        second = _latest(h.url, "beta")
        assert second != first
        # The folder entered before the new snapshot stays on the one it was pinned to...
        assert (mp / "beta" / "class1" / "img0001.jpg").read_bytes() == old
        # ...and any snapshot is reachable by name, without being listed.
        assert (mp / f"beta@{second}" / "class1" / "img0001.jpg").read_bytes() == \
            b"a new version of the file"
        assert (mp / f"beta@{first}" / "class1" / "img0001.jpg").read_bytes() == old
        assert f"beta@{second}" not in os.listdir(mp)
        # A second mount, pinned ahead to the first snapshot, shows that one as "beta".
        with MountProcess(f"{s.url}/", mp2, "--pin", f"beta@{first}", env=env):
            assert (mp2 / "beta" / "class1" / "img0001.jpg").read_bytes() == old
        with MountProcess(f"{s.url}/", mp2, env=env):
            assert (mp2 / "beta" / "class1" / "img0001.jpg").read_bytes() == \
                b"a new version of the file"


@needs_fuse
def test_a_pin_of_an_unknown_dataset_stops_the_mount(
        stack: tuple[dict[str, Path], ServerProcess, ServerProcess, Path],
        tmp_path: Path) -> None:
    _, _, s, _ = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    with pytest.raises(MountError, match="secret"):
        MountProcess(f"{s.url}/", mp, "--pin", "secret@0badc0de",
                     env={"SPOKEFS_TOKEN": READER}).start(timeout=30)
    assert not sysfs.is_mounted(mp)
    with pytest.raises(MountError, match="--pin is for a namespace mount"):
        MountProcess(f"{s.url}/alpha", mp, "--pin", "alpha@0badc0de",
                     env={"SPOKEFS_TOKEN": READER}).start(timeout=30)


@needs_fuse
def test_the_charts_namespace_mount_container_mounts_reads_and_unmounts(
        spoke_server: ServerProcess, dataset: Path, tmp_path: Path) -> None:
    """The mount DaemonSet's container of a namespace release (mount.namespace), run as the
    kubelet runs it (its command and args, spokefs on PATH) against a real spoke: the whole
    namespace appears at hostPath, its readiness probe passes, a file reads back, and its
    preStop hook unmounts and ends it."""
    pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
    import subprocess
    import time

    from test_helm_chart import render

    node = tmp_path / "node" / "spokefs"
    docs = render({"auth": {"enabled": False}, "tls": {"enabled": False},
                   "hub": {"enabled": False}, "spoke": {"enabled": False},
                   "mount": {"namespace": True, "spokeUrl": spoke_server.url,
                             "hostPath": str(node)}})
    [c] = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"][
        "containers"]
    env = {**os.environ, "HOME": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "mount.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*c["command"], *c["args"]], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 60
        while not os.path.ismount(node):
            assert proc.poll() is None, f"the mount exited {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < end, f"not mounted in 60 s: {log.read_text()}"
            time.sleep(0.1)
        probe = c["readinessProbe"]["exec"]["command"]
        assert subprocess.run(probe, env=env).returncode == 0
        assert sorted(os.listdir(node)) == ["ds"]  # the hub's one dataset, as a folder
        rel = "shards/shard-001.tar"
        assert (node / "ds" / rel).read_bytes() == (dataset / rel).read_bytes()
        stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert subprocess.run(stop, env=env).returncode == 0
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert not os.path.ismount(node)
        assert subprocess.run(probe, env=env).returncode != 0  # not ready once unmounted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if os.path.ismount(node):
            subprocess.run(["umount", "-l", str(node)], check=False)
