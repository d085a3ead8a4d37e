"""Running a mount: load the snapshot, mount, serve FUSE requests, unmount cleanly.

The order matters: the manifest is loaded (and ``latest`` pinned) before anything is mounted,
so a mountpoint never appears that cannot answer ``ls``; readiness is announced only after a
``stat`` of the mountpoint has gone through the kernel and back, so whoever waits for it can
read at once. SIGTERM and SIGINT end the FUSE loop and unmount.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spokefs.errors import ConfigError, ReadFailed, UpstreamUnavailable
from spokefs.mount import sysfs
from spokefs.mount.coalesce import Coalescer
from spokefs.mount.inodes import InodeTable, Perms
from spokefs.mount.metrics import ready_note, serve_python
from spokefs.mount.native import choose, serve_native
from spokefs.mount.process import unmount
from spokefs.mount.source import EmbeddedSource, Source, Target, UpstreamSource, retry_until
from spokefs.units import format_size
from spokefs.wire.client import UpstreamClient
from spokefs.wire.paths import split_dataset_ref

if TYPE_CHECKING:
    from spokefs.mount.fs import SnapshotFS

log = logging.getLogger(__name__)

DEFAULT_READ_AHEAD_KB = 4096  # measured best on loopback (docs/mount.md); 128 is the default
MAX_TASKS = 128               # FUSE requests served at once (kernel readahead sends several)
FETCH_UNIT = 4 * 1024 * 1024  # largest fetch of a streaming read


@dataclass
class MountOptions:
    url: str
    mountpoint: Path
    cache_dir: Path | None = None      # set: embed a cache instead of reading a spoke service
    cache_size: int = 0
    deadline: float = 30.0
    allow_other: bool = False
    read_ahead_kb: int = DEFAULT_READ_AHEAD_KB
    short_circuit: bool = True         # read the spoke's cache files when on its host
    spoke_cache: Path | None = None    # the spoke's cache folder here (else its status's)
    engine: str = "auto"               # auto, native (Rust daemon), python (spokefs.mount.native)
    writable: bool = False             # new files may be written (native engine only)
    commit_marker: str | None = ".metadata"  # a writable mount publishes its folder on it
    write_passthrough: bool = False    # the kernel writes new files' staging files itself
    uid: int | None = None             # what stat shows (None: the mounting user's)
    gid: int | None = None
    file_mode: int | None = None       # None: each file's own bits from the snapshot
    dir_mode: int | None = None        # None: 0o555
    extra_options: tuple[str, ...] = ()  # more kernel options (-o noexec)
    metrics_port: int | None = None    # serve the mount's /metrics here (0: any free port)
    metrics_addr: str = "127.0.0.1"
    pins: tuple[str, ...] = ()         # a namespace mount's DATASET@SNAPSHOT pins


def perms(opts: MountOptions) -> Perms:
    """The owner and permission bits both engines show."""
    return Perms(os.getuid() if opts.uid is None else opts.uid,
                 os.getgid() if opts.gid is None else opts.gid, opts.file_mode,
                 0o555 if opts.dir_mode is None else opts.dir_mode)


def fuse_options(opts: MountOptions) -> set[str]:
    # nosuid, nodev: what a dataset holds is data, never a privilege or a device.
    o = {"fsname=spokefs", "subtype=spokefs", "default_permissions", "nosuid", "nodev"}
    if not opts.writable:
        o.add("ro")
    if opts.allow_other:
        o.add("allow_other")
    o.update(opts.extra_options)
    return o


def make_source(opts: MountOptions) -> Source:
    target = Target.parse(opts.url)
    if opts.cache_dir is not None:
        return EmbeddedSource(target, opts.cache_dir, opts.cache_size, opts.deadline)
    return UpstreamSource(target, opts.deadline, short_circuit=opts.short_circuit,
                          spoke_cache=opts.spoke_cache)


def clear_stale(mountpoint: Path) -> None:
    """Refuse a live mount; lazily unmount a dead one (its process is gone: ENOTCONN)."""
    if sysfs.is_mounted(mountpoint):
        try:
            os.statvfs(mountpoint)  # statfs always reaches the filesystem; stat may be cached
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise ConfigError(f"cannot use mountpoint {mountpoint}: {exc.strerror}") from exc
            log.warning("%s is a dead mount (transport endpoint not connected); unmounting it",
                        mountpoint)
            try:
                unmount(mountpoint)
            except OSError as err:
                raise ConfigError(f"cannot clear the dead mount at {mountpoint}: "
                                  f"{err.strerror}") from err
        else:
            raise ConfigError(f"{mountpoint} is already mounted; run `spokefs umount "
                              f"{mountpoint}` first")
    if not mountpoint.is_dir():
        raise ConfigError(f"mountpoint {mountpoint} is not a directory (create it first)")


async def serve(opts: MountOptions, on_ready: Callable[[str], None]) -> None:
    """Mount and serve until unmounted or signalled; ``on_ready(message)`` once usable.
    pyfuse3 is imported by the python engine only: the native engine needs none of it."""
    mountpoint = opts.mountpoint.absolute()
    clear_stale(mountpoint)
    engine = choose(opts)
    if Target.parse(opts.url).namespace:
        await _serve_namespace(opts, mountpoint, on_ready)
        return
    source = make_source(opts)
    try:
        t0 = time.monotonic()
        try:
            manifest = await source.open()
        except ReadFailed as exc:
            raise UpstreamUnavailable(f"cannot mount {source.target}: {exc}",
                                      source.target.base, str(exc)) from exc
        log.info("snapshot %s@%s: %d files, %s, loaded in %.2fs", manifest.dataset,
                 manifest.snapshot, len(manifest), format_size(manifest.total_bytes),
                 time.monotonic() - t0)
        if engine == "native":
            assert isinstance(source, UpstreamSource)  # choose(): no embedded cache
            held = [manifest]  # the daemon copies the columns: let them go after
            del manifest
            await serve_native(opts, mountpoint, source, held.pop(), on_ready,
                               fuse_options(opts))
            return
        import pyfuse3.asyncio

        from spokefs.mount.fs import SnapshotFS

        pyfuse3.asyncio.enable()
        table = InodeTable(manifest)
        del manifest  # the table keeps the columns it needs
        # Fetch in blocks of the dataset, but no more than 4 MiB at a time (a dataset with
        # huge blocks would otherwise hold few of them per stream).
        reader = Coalescer(source.read_into, min(table.block_size, FETCH_UNIT))
        try:
            await _serve_fuse(opts, mountpoint, SnapshotFS(table, reader, perms(opts)),
                              on_ready, f"{table.dataset}@{table.snapshot}",
                              f"{table.file_count} files, {format_size(table.total_bytes)}, ")
        finally:
            await reader.close()
    finally:
        await source.close()


async def _serve_namespace(opts: MountOptions, mountpoint: Path,
                           on_ready: Callable[[str], None]) -> None:
    """A mount of every dataset the upstream lists (``mount/namespace.py``): each member a
    source of its own, made when its folder is first entered and closed at unmount."""
    import pyfuse3.asyncio

    from spokefs.mount.namespace import Member, NamespaceFS, NamespaceTable

    target = Target.parse(opts.url)
    pins = parse_pins(opts.pins)
    client = UpstreamClient(target.base, max_connections=4,
                            request_timeout=max(opts.deadline, 1.0))
    sources: list[tuple[UpstreamSource, Coalescer]] = []

    async def list_datasets() -> list[str]:
        doc = await retry_until(opts.deadline, f"the datasets of {target.base}",
                                lambda: client.get_json("/v1/datasets"))
        return [str(d["name"]) for d in doc.get("datasets", [])]

    async def load(m: Member) -> tuple[InodeTable, Coalescer]:
        source = UpstreamSource(Target(target.base, m.dataset, m.snapshot), opts.deadline,
                                short_circuit=opts.short_circuit, spoke_cache=opts.spoke_cache)
        try:
            manifest = await source.open()
        except BaseException:
            await source.close()
            raise
        table = InodeTable(manifest)
        reader = Coalescer(source.read_into, min(table.block_size, FETCH_UNIT))
        sources.append((source, reader))
        return table, reader

    try:
        try:
            names = await list_datasets()
        except ReadFailed as exc:
            raise UpstreamUnavailable(f"cannot mount {target}: {exc}", target.base,
                                      str(exc)) from exc
        unknown = sorted(set(pins) - set(names))
        if unknown:
            raise ConfigError(f"--pin names datasets {target.base} does not list to this "
                              f"token: {', '.join(unknown)}")
        table = NamespaceTable(time.time_ns(), pins)
        table.set_listing(names, time.monotonic())
        log.info("namespace %s: %d datasets%s", target, len(names),
                 f", pinned: {', '.join(f'{d}@{s}' for d, s in sorted(pins.items()))}"
                 if pins else "")
        pyfuse3.asyncio.enable()
        ops = NamespaceFS(table, load, list_datasets, perms(opts))
        await _serve_fuse(opts, mountpoint, ops, on_ready, f"namespace {target}",
                          f"{len(names)} datasets, ")
    finally:
        for source, reader in sources:
            await reader.close()
            await source.close()
        await client.close()


def parse_pins(pins: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["imagenet@3fa9c1d2"]`` -> ``{"imagenet": "3fa9c1d2"}``; ConfigError for a pin that
    names no snapshot or a dataset twice."""
    out: dict[str, str] = {}
    for pin in pins:
        dataset, snap = split_dataset_ref(pin.strip())
        if "@" not in pin or snap == "latest":
            raise ConfigError(f"--pin {pin!r}: expected DATASET@SNAPSHOT")
        if dataset in out:
            raise ConfigError(f"--pin {pin!r}: dataset {dataset!r} is pinned twice")
        out[dataset] = snap
    return out


async def _serve_fuse(opts: MountOptions, mountpoint: Path, ops: SnapshotFS,
                      on_ready: Callable[[str], None], what: str, detail: str) -> None:
    import pyfuse3

    loop = asyncio.get_running_loop()
    metrics = serve_python(ops, str(mountpoint), what, opts.metrics_addr, opts.metrics_port)
    try:
        pyfuse3.init(ops, str(mountpoint), fuse_options(opts))
    except RuntimeError as exc:  # libfuse printed the reason on stderr
        if metrics is not None:
            metrics.close()
        raise ConfigError(f"cannot mount at {mountpoint}: {exc} (see the fuse message above; "
                          "is /dev/fuse usable and fusermount3 installed?)") from exc
    try:
        stopping = False

        def stop() -> None:
            nonlocal stopping
            if not stopping:
                stopping = True
                log.info("signal received: unmounting %s", mountpoint)
                pyfuse3.terminate()

        def on_error(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
            # pyfuse3's asyncio shim may set_result on a future that terminate() already
            # failed; after terminate that is noise, not an error.
            if stopping and isinstance(context.get("exception"), asyncio.InvalidStateError):
                return
            loop.default_exception_handler(context)

        loop.set_exception_handler(on_error)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        main = asyncio.ensure_future(pyfuse3.main(min_tasks=1, max_tasks=MAX_TASKS))
        # A stat that the kernel forwards to us and back proves the mount answers.
        probe = asyncio.ensure_future(asyncio.to_thread(os.stat, mountpoint))
        await asyncio.wait({main, probe}, return_when=asyncio.FIRST_COMPLETED)
        if probe.done():
            try:
                if probe.result().st_ino != pyfuse3.ROOT_INODE:
                    raise RuntimeError(f"{mountpoint} did not come up as a spokefs mount")
            except BaseException:
                pyfuse3.terminate()
                await main
                raise
            # Only now: the kernel lowers readahead to what INIT offered (128 KiB) when it
            # processes INIT, which happens in the first request the loop serves.
            ra = sysfs.set_read_ahead_kb(mountpoint, opts.read_ahead_kb)
            on_ready(f"spokefs mount ready: {what} at {mountpoint} ({detail}engine=python, "
                     f"read_ahead_kb={ra if ra is not None else 'unchanged'}"
                     f"{ready_note(metrics)})")
        await main
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # libfuse detaches lazily as root (MNT_DETACH), so busy readers cannot block this.
        pyfuse3.close(unmount=True)
        if metrics is not None:
            metrics.close()
        c = ops.counters
        log.info("unmounted %s: %d reads, %s, %d failed", mountpoint, c.reads,
                 format_size(c.read_bytes), c.read_errors)
