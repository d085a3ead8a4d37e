"""The same-host handoff (``spoke/handoff.py``, ``client/handoff.py``): a finished file given
to the spoke by descriptor on ``CACHE_DIR/handoff.sock`` is held whole, as a PUT of its bytes
would leave it, and published by a commit; the socket is held to the upload route's scopes and
refuses descriptors it may not read. Real hub and spoke processes, a real unix socket."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from servers import output_with
from spokefs.client.handoff import HandoffUnavailable, hand_off, socket_path
from spokefs.client.uploads import file_version
from spokefs.errors import BadRequest, Conflict, Forbidden, SpokeError, Unauthorized
from spokefs.hub.uploads import ADOPTING, INCOMING
from spokefs.mount.process import MountProcess, fuse_unusable
from test_writeback import (
    BLOCK,
    READER,
    WRITER,
    Site,
    _published,
    handoffs,
    site_fixture,  # noqa: F401  (the fixture `site`)
)


def _give(site: Site, path: str, f: Path | int, token: str | None = WRITER,
          dataset: str = "ckpt", size: int | None = None) -> dict:
    sock = socket_path(site.tmp / "cache")
    if isinstance(f, int):
        return hand_off(sock, token, dataset, path, f, size if size is not None else 0)
    with open(f, "rb") as fh:
        return hand_off(sock, token, dataset, path, fh.fileno(),
                        f.stat().st_size if size is None else size)


def _held(site: Site) -> list[dict]:
    return site.writer().writeback()["uploads"]


def test_a_file_handed_over_is_held_whole_and_published(site: Site, tmp_path: Path) -> None:
    files = {}
    for i, size in enumerate((0, 5, BLOCK, 3 * BLOCK + 17, 9 << 20)):
        files[f"step-1/r{i}.distcp"] = p = tmp_path / f"r{i}"
        p.write_bytes(os.urandom(size))
    for path, p in files.items():
        with open(p, "rb") as f:
            want = file_version(f, BLOCK)
        got = _give(site, path, p)
        assert (got["dataset"], got["path"], got["size"], got["version"], got["whole"]) == \
            ("ckpt", path, *want, True)
    held = {u["path"]: u for u in _held(site)}
    assert sorted(held) == sorted(files) and all(u["whole"] for u in held.values())
    assert handoffs(site) == len(files)
    # Handed over again (a retry whose answer was lost): held once, the same.
    again = _give(site, "step-1/r3.distcp", files["step-1/r3.distcp"])
    assert again["version"] == held["step-1/r3.distcp"]["version"]
    up = site.writer()
    up.commit(prefix="step-1/")
    assert up.wait_safe("step-1/", timeout=60)
    assert set(files) <= set(_published(site))
    for path, p in files.items():
        assert (site.ckpt / path).read_bytes() == p.read_bytes()


def test_a_handoff_is_held_to_the_upload_routes_scopes(site: Site, tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 1000)
    with pytest.raises(Unauthorized):
        _give(site, "a/f", p, token=None)
    with pytest.raises(Unauthorized):
        _give(site, "a/f", p, token="not-a-token-" + "z" * 20)
    with pytest.raises(Forbidden, match="may not write dataset 'ckpt'"):
        _give(site, "a/f", p, token=READER)  # read:ckpt: reads, never writes
    with pytest.raises(Forbidden, match="read-only at its hub"):
        _give(site, "a/f", p, dataset="ro")
    for bad in ("../f", "/etc/passwd", f"{INCOMING}/x", ""):
        with pytest.raises(BadRequest):
            _give(site, bad, p)
    with pytest.raises(BadRequest, match="dataset name"):
        _give(site, "a/f", p, dataset="../ckpt")
    assert _held(site) == [] and handoffs(site) == 0
    assert site.spoke is not None  # each refusal is logged with who asked
    assert f"from unix pid {os.getpid()} uid {os.getuid()} refused (403)" in \
        output_with(site.spoke, "refused (403)")


def test_a_handoff_refuses_what_it_may_not_read(site: Site, tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"y" * 4096)
    with pytest.raises(Conflict, match="holds 4096 bytes, not 4000"):
        _give(site, "a/f", p, size=4000)  # still being written, or lying
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    r, w = os.pipe()
    try:
        for fd in (d, r):
            with pytest.raises(BadRequest, match="regular file"):
                _give(site, "a/f", fd)
    finally:
        for fd in (d, r, w):
            os.close(fd)
    wo = os.open(p, os.O_WRONLY)
    try:  # a descriptor the spoke cannot read from: refused, nothing held
        with pytest.raises(SpokeError):
            _give(site, "a/f", wo, size=4096)
    finally:
        os.close(wo)
    # Not the protocol: no descriptor, too many, not JSON. Each answered 400.
    sock = str(socket_path(site.tmp / "cache"))
    for fds, msg in (([], b'{"dataset": "ckpt", "path": "a", "size": 0}'),
                     ([0, 1], b'{"dataset": "ckpt", "path": "a", "size": 0}'),
                     ([0], b"not json"), ([0], b'{"dataset": "ckpt", "path": "a"}'),
                     ([0], b'{"dataset": "ckpt", "path": "a", "size": "9"}')):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(sock)
            socket.send_fds(s, [msg], fds)
            assert json.loads(s.recv(65536))["status"] == 400, msg
    assert _held(site) == [] and handoffs(site) == 0


@pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))
def test_a_file_on_a_fuse_mount_is_not_read_by_the_spoke(site: Site, tmp_path: Path) -> None:
    """A read of a FUSE file waits on its daemon: here the spoke's own mount of a dataset,
    whose reads the spoke itself answers. Refused before any read."""
    assert site.spoke is not None
    mp = tmp_path / "mnt"
    mp.mkdir()
    with MountProcess(f"{site.spoke.url}/ro", mp, env={"SPOKEFS_TOKEN": READER}), \
            pytest.raises(BadRequest, match="FUSE"):
        _give(site, "a/f", mp / "a.txt")
    assert _held(site) == []


def test_without_a_spoke_the_writer_is_told_to_send_over_http(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"z")
    with open(p, "rb") as f, pytest.raises(HandoffUnavailable):
        hand_off(tmp_path / "handoff.sock", WRITER, "ckpt", "a", f.fileno(), 1)


def _while_copying(site: Site, big: Path, act: Callable[[], object]) -> list[BaseException]:
    """``big`` handed over in a thread; ``act`` run once the spoke is seen copying it in (the
    upload's metadata says ``adopting``); what the handoff raised, once it has ended."""
    incoming = site.tmp / "cache" / "writeback" / "ckpt" / "data" / INCOMING
    failed: list[BaseException] = []

    def give() -> None:
        try:
            _give(site, "step-1/big.distcp", big)
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=give)
    t.start()
    seen = False
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and not seen:
        for meta in incoming.glob("*.json") if incoming.is_dir() else []:
            try:
                seen = json.loads(meta.read_bytes())["version"] == ADOPTING
            except (ValueError, FileNotFoundError):
                continue
        time.sleep(0.001)
    try:
        assert seen, "the copy was never seen under way"
        act()
    finally:
        t.join(30)
    return failed


def test_a_spoke_killed_mid_handoff_holds_nothing_half_and_takes_it_again(
        tmp_path: Path) -> None:
    """kill -9 of the spoke while it copies a file in: after the restart the upload is not
    whole (never sent to the hub, never committed), and the handoff made again holds it
    whole."""
    site = Site(tmp_path)
    site.start_hub()
    site.start_spoke()
    assert site.spoke is not None
    big = tmp_path / "big"
    big.write_bytes(os.urandom(256 << 20))
    try:
        failed = _while_copying(site, big, site.spoke.kill)
        assert failed and isinstance(failed[0], HandoffUnavailable | SpokeError), failed
        site.start_spoke()
        held = _held(site)
        assert all(not u["whole"] for u in held), held
        got = _give(site, "step-1/big.distcp", big)
        with open(big, "rb") as f:
            assert got["version"] == file_version(f, BLOCK)[1]
        assert [u["whole"] for u in _held(site)] == [True]
        up = site.writer()
        up.commit(prefix="step-1/")
        assert up.wait_safe("step-1/", timeout=120)
        assert (site.ckpt / "step-1" / "big.distcp").read_bytes() == big.read_bytes()
    finally:
        site.close()


def test_a_file_written_while_it_is_copied_in_is_refused_whole(site: Site,
                                                                tmp_path: Path) -> None:
    """A writer that goes on writing after it handed its file over (a bug, or a second
    writer): the copy the spoke made is not what the file now holds, so it is dropped and
    the writer told (409); handed over again once it is done, the file is held as it is
    then."""
    big = tmp_path / "big"
    big.write_bytes(os.urandom(256 << 20))

    def grow() -> None:
        with open(big, "ab") as f:
            f.write(b"written after the handoff")

    failed = _while_copying(site, big, grow)
    assert len(failed) == 1 and isinstance(failed[0], Conflict), failed
    assert "changed while it was copied in" in str(failed[0])
    assert _held(site) == []
    got = _give(site, "step-1/big.distcp", big)
    with open(big, "rb") as f:
        assert (got["size"], got["version"]) == file_version(f, BLOCK)
    assert [u["whole"] for u in _held(site)] == [True]


def test_fsspec_writes_on_the_spokes_host_are_handed_over(
        site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``spokefs://`` files closed on the spoke's host go by descriptor where the writer is
    told the spoke's cache folder (a write token is not shown it), and are published whole;
    a folder that is not the spoke's (no key of its user) is not trusted: a socket listening
    there is never shown the token, and the files go over HTTP."""
    import fsspec

    assert site.spoke is not None
    monkeypatch.setenv("SPOKEFS_TOKEN", WRITER)
    url = f"spokefs://{site.spoke.hostport}/ckpt"
    shards = {f"__{i}_0.distcp": os.urandom(BLOCK + 100 * i) for i in range(3)}
    planted = tmp_path / "planted"
    planted.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as trap:
        trap.bind(str(socket_path(planted)))
        trap.listen()
        for step, options, handed in (("s1", {}, 0),
                                      ("s2", {"spoke_cache": str(planted)}, 0),
                                      ("s3", {"spoke_cache": str(tmp_path / "cache")}, 4)):
            before = handoffs(site)
            fs = fsspec.filesystem("spokefs", skip_instance_cache=True, **options)
            for name, data in [*shards.items(), (".metadata", b"meta")]:
                with fs.open(f"{url}/{step}/{name}", "wb") as f:
                    f.write(data)
            assert handoffs(site) - before == handed, step
            assert site.writer().wait_safe(f"{step}/", timeout=60)
            for name, data in shards.items():
                assert (site.ckpt / step / name).read_bytes() == data
        trap.setblocking(False)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody connected
