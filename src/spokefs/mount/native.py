"""The native engine: the mount's FUSE daemon in Rust (``spokefs._native.Mount``, built from
native/mount), behind the same ``spokefs mount`` command.

Python keeps the setup: clearing a stale mount, resolving the snapshot and loading its
manifest, the short-circuit probe, readiness (a stat through the kernel), readahead, logging,
daemonising and ``spokefs umount``. It then hands Rust, in one call, the manifest's columns
and the settings; from then on no FUSE request touches Python. Python waits (the GIL
released), unmounts on SIGTERM or SIGINT, and passes the daemon's log lines on to its logging.

``choose`` picks the engine: ``auto`` is native when the URL is plain http, there is no
embedded cache (``--cache-dir`` stays Python) and the extension module has the mount; else
python. Which one, and why, is logged.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from spokefs.errors import ConfigError, SpokeError
from spokefs.manifest import Manifest
from spokefs.mount import sysfs
from spokefs.mount.metrics import ready_note
from spokefs.mount.metrics import serve_native as metrics_endpoint
from spokefs.mount.source import Target, UpstreamSource
from spokefs.units import format_size
from spokefs.wire.auth import client_token
from spokefs.wire.headers import H_INTERNAL

if TYPE_CHECKING:
    from spokefs.client.uploads import Uploader
    from spokefs.mount.run import MountOptions

log = logging.getLogger(__name__)

ENGINES = ("auto", "native", "python")
ROOT_INODE = 1
WAIT_STEP = 0.5  # seconds a wait for the unmount lasts; signals and log lines come between


def unavailable() -> str | None:
    """Why the native mount cannot run in this build (None when it can)."""
    try:
        from spokefs import _native
    except ImportError as exc:
        return f"the extension module spokefs._native is not importable ({exc})"
    if not hasattr(_native, "Mount"):
        return "this build of spokefs._native has no Mount"
    return None


def choose(opts: MountOptions) -> str:
    """``native`` or ``python`` for these options (logged); ConfigError when ``--engine
    native`` was asked for and cannot be had."""
    if opts.engine not in ENGINES:
        raise ConfigError(f"--engine {opts.engine!r}: use one of {', '.join(ENGINES)}")
    if opts.engine == "python":
        log.info("engine: python (asked for)")
        return "python"
    why = None
    target = Target.parse(opts.url)
    if opts.writable and opts.engine == "python":
        raise ConfigError("--writable runs in the native engine only")
    if opts.cache_dir is not None:
        why = "an embedded cache (--cache-dir) runs in the python engine only"
    elif target.namespace:
        why = "a namespace mount (a URL without a dataset) runs in the python engine only"
    elif target.base.startswith("https://"):
        why = "the native engine reads plain http only (no TLS yet)"
    else:
        why = unavailable()
    if why is None:
        log.info("engine: native")
        return "native"
    if opts.engine == "native" or opts.writable:
        raise ConfigError(f"{'--writable' if opts.writable else '--engine native'}: {why}")
    log.info("engine: python (%s)", why)
    return "python"


async def _writable(opts: MountOptions, source: UpstreamSource, dataset: str
                    ) -> tuple[Uploader, Path]:
    """The uploader of a ``--writable`` mount (the dataset checked to take writes) and its
    staging folder (made here, private, removed at unmount)."""
    from spokefs.client.uploads import Uploader
    from spokefs.client.writer import staging_dir

    up = Uploader(source.target.base, dataset, token=client_token(), deadline=opts.deadline)
    try:
        await asyncio.to_thread(up.check_writable)
    except SpokeError as exc:
        raise ConfigError(f"--writable: {exc}") from exc
    sweep_staging(Path(staging_dir()))
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=staging_dir()))
    log.info("writable: new files are staged in %s until the spoke holds them", staging)
    return up, staging


STAGING_PREFIX = "spokefs-mount-"
STAGING_LOCK = ".owner.lock"


def hold_staging(staging: Path) -> int:
    """Lock ``staging`` for this process's life (the descriptor returned; close it after the
    folder is removed). The kernel drops the lock when the process dies, however it dies, so
    a later mount can tell a dead mount's folder from a live one in another PID namespace
    sharing the same folder, which a pid could not."""
    part = staging / f"{STAGING_LOCK}.part"
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    part.rename(staging / STAGING_LOCK)  # visible to a sweep only once locked
    return fd


def sweep_staging(folder: Path) -> list[Path]:
    """Remove the staging folders of writable mounts that died without cleaning up (kill -9,
    a lost node); the ones removed. What such a folder holds is safe to drop: a file whose
    close returned is held by the spoke, and one whose close did not was never acknowledged.
    A folder without a lock file is left alone (made by another version, or mid-creation)."""
    removed = []
    for path in folder.glob(f"{STAGING_PREFIX}*"):
        try:
            fd = os.open(path / STAGING_LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its mount is alive
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        log.info("writable: removed %s, left by a mount that is gone", path)
        removed.append(path)
    return removed


def _drain(mount: object) -> None:
    for level, message in mount.take_logs():  # type: ignore[attr-defined]
        log.log(level, "%s", message)


async def serve_native(opts: MountOptions, mountpoint: Path, source: UpstreamSource,
                       manifest: Manifest, on_ready: Callable[[str], None],
                       options: set[str]) -> None:
    """Mount ``manifest`` with the native daemon and serve until unmounted or signalled."""
    from spokefs import _native

    sc = None
    local = source.local
    if local is not None:  # the probe's findings go to Rust; Python's reader is not used
        sc = {"cache_dir": str(local.cache.dir), "cache_id": local.cache.id,
              "chunk_size": local.cache.chunk_size, "key": local._key[H_INTERNAL]}
        local.cache.close()
        source.local = None
    m = manifest
    staging, uploader = None, None
    held = None
    if opts.writable:
        uploader, staging = await _writable(opts, source, m.dataset)
        held = hold_staging(staging)
    mount = _native.Mount(
        str(mountpoint), paths=m.paths, sizes=m.sizes, modes=m.modes, mtimes_ns=m.mtimes,
        versions=m.versions, dirs=m.dirs, block_size=m.block_size, dataset=m.dataset,
        snapshot=m.snapshot, base_url=source.target.base, token=client_token(),
        deadline_s=opts.deadline, options=sorted(options), uid=os.getuid(), gid=os.getgid(),
        created_ns=int(m.created * 1e9), short_circuit=sc, file_uid=opts.uid,
        file_gid=opts.gid, file_mode=opts.file_mode,
        # New files go into the snapshot's folders: writable to their owner.
        dir_mode=opts.dir_mode if opts.dir_mode is not None or not opts.writable else 0o755,
        staging=None if staging is None else str(staging),
        write_passthrough=opts.write_passthrough)
    writes = None
    if uploader is not None:
        from spokefs.client.handoff import socket_path
        from spokefs.mount.writes import MountWrites

        # On the spoke's host (the short circuit found its cache folder), finished files
        # are handed to it by descriptor.
        uploader.handoff = socket_path(sc["cache_dir"]) if sc is not None else None
        writes = MountWrites(mount, uploader, opts.commit_marker)
    dataset, snapshot = m.dataset, m.snapshot
    del m, manifest
    await source.close()  # the setup's HTTP clients; the daemon has its own
    metrics = metrics_endpoint(mount, str(mountpoint), f"{dataset}@{snapshot}",
                               opts.metrics_addr, opts.metrics_port)
    try:
        await asyncio.to_thread(mount.start)
        if writes is not None:
            writes.start()
    except ConfigError as exc:
        if metrics is not None:
            metrics.close()
        raise ConfigError(f"{exc} (is /dev/fuse usable and fusermount3 installed?)") from exc
    loop = asyncio.get_running_loop()
    stopping = False

    def stop() -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            log.info("signal received: unmounting %s", mountpoint)
            try:
                mount.unmount()
            except ConfigError as exc:
                log.error("%s", exc)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        # A stat that the kernel forwards to the daemon and back proves the mount answers.
        st = await asyncio.to_thread(os.stat, mountpoint)
        if st.st_ino != ROOT_INODE:
            raise ConfigError(f"{mountpoint} did not come up as a spokefs mount")
        # Only now: the kernel sets readahead from INIT, which the first request completes.
        ra = sysfs.set_read_ahead_kb(mountpoint, opts.read_ahead_kb)
        _drain(mount)  # what the session's start said (the way writes go) comes before ready
        on_ready(f"spokefs mount ready: {dataset}@{snapshot} at {mountpoint} "
                 f"({mount.file_count} files, {format_size(mount.total_bytes)}, engine=native, "
                 f"read_ahead_kb={ra if ra is not None else 'unchanged'}"
                 f"{ready_note(metrics)})")
        while not await asyncio.to_thread(mount.wait, WAIT_STEP):
            _drain(mount)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if not stopping:
            try:  # detached lazily, so busy readers cannot block this
                mount.unmount()
            except ConfigError as exc:
                log.error("%s", exc)
        await asyncio.to_thread(mount.close)
        _drain(mount)
        if writes is not None:
            await asyncio.to_thread(writes.join, 10.0)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if held is not None:
            os.close(held)
        if metrics is not None:
            metrics.close()
        c = mount.counters()
        log.info("unmounted %s: %d reads, %s, %d failed (native: %d from the spoke's cache "
                 "files, %d over HTTP, %d short-circuit fallbacks)", mountpoint, c["reads"],
                 format_size(c["read_bytes"]), c["read_errors"], c["short_circuit_reads"],
                 c["http_reads"], c["fallbacks"])
