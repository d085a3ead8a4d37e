"""A torch.distributed.checkpoint saved by two CPU ranks (gloo) near the compute, pushed to
a writable dataset and committed as one snapshot, then loaded by two ranks elsewhere through
a spoke and a mount with DCP's own FileSystemReader: every tensor as saved
(docs/checkpoints.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servers import free_port, hub, spoke
from spokefs.checkpoint import wait_safe
from spokefs.client.sync import Client
from spokefs.client.uploads import Uploader, put_tree
from spokefs.mount.process import MountProcess, fuse_unusable

FUSE_REASON = fuse_unusable()
WORKER = Path(__file__).with_name("dcp_worker.py")
RANKS = 2


def ranks(mode: str, path: Path | str) -> list[subprocess.CompletedProcess[str]]:
    """``mode`` run by every rank at once; their results, in rank order."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(path)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(RANKS),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(RANKS)]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, text))
    return out


@pytest.mark.skipif(FUSE_REASON is not None, reason=f"no FUSE: {FUSE_REASON}")
def test_a_dcp_checkpoint_pushed_and_committed_loads_through_a_mount(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.checkpoint")
    local = tmp_path / "local" / "step-1"
    for r in ranks("save", local):
        assert r.returncode == 0, r.stdout
    assert (local / ".metadata").is_file()

    folder = tmp_path / "ckpt"
    folder.mkdir()
    with hub(folder, tmp_path / "hubstate", "--writable", "ckpt") as h:
        up = Uploader(h.url, "ckpt", token=None)
        sent = put_tree(up, local, "run/step-1")
        assert len(sent) == RANKS + 1  # a file per rank, and .metadata
        up.commit(prefix="run/step-1/")
        (tmp_path / "mnt").mkdir()
        with spoke(h.url, tmp_path / "cache", "256MiB") as s, \
                MountProcess(f"{s.url}/ckpt", tmp_path / "mnt", "--deadline", "5s"):
            loaded = ranks("load", tmp_path / "mnt" / "run" / "step-1")
    for r in loaded:
        assert r.returncode == 0 and "differing []" in r.stdout, r.stdout


def test_a_dcp_checkpoint_saved_to_a_spokefs_url_is_published_whole(tmp_path: Path) -> None:
    """DCP's FsspecWriter on a ``spokefs://`` URL of a spoke: each rank's file is uploaded as
    it is closed (durable at the spoke, which writes back to the hub), and rank 0's
    ``.metadata`` (written as .metadata.tmp, then renamed) commits the folder: the hub
    publishes every rank's file and the metadata at once. FsspecReader loads it back."""
    pytest.importorskip("torch.distributed.checkpoint")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with hub(folder, tmp_path / "hubstate", "--writable", "ckpt") as h, \
            spoke(h.url, tmp_path / "cache", "256MiB") as s:
        url = f"spokefs://{s.hostport}/ckpt/run/step-2"
        for r in ranks("save-fsspec", url):
            assert r.returncode == 0, r.stdout
        assert wait_safe(f"{s.url}/ckpt/run/step-2", timeout=60)
        m = Client(h.url, token=None).manifest("ckpt", "latest")
        got = sorted(p for p in m.paths if p.startswith("run/step-2/"))
        assert got == ["run/step-2/.metadata", "run/step-2/__0_0.distcp",
                       "run/step-2/__1_0.distcp"], got
        assert not Uploader(h.url, "ckpt", token=None).listing()  # the .tmp was discarded
        # By snapshot: a spoke's worker trusts the "latest" it knew for --latest-ttl.
        snap = Client(h.url, token=None).resolve("ckpt", "latest")
        for r in ranks("load-fsspec", f"spokefs://{s.hostport}/ckpt@{snap}/run/step-2"):
            assert r.returncode == 0 and "differing []" in r.stdout, r.stdout
