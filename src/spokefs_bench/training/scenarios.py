"""The scenarios: where the same loop reads the same data from.

Each scenario registers by name: whether it crosses the link, why it cannot run here (or
None), and a context manager that sets up its reader (spoke, mount, peer mount, staged copy),
yields a ``Prepared`` and tears everything down. Services run as real processes
(``spokefs.procs.Service``); the link is ``spokefs wan`` in front of the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import Sampler

from spokefs.mount.process import MountError, fuse_unusable, unmount, wait_mounted
from spokefs.procs import Service, spoke_args
from spokefs_bench.common import spokefs_mount
from spokefs_bench.training.datasets import BuiltDataset
from spokefs_bench.training.loop import EpochSampler
from spokefs_bench.training.openers import FileOpener, FsspecOpener, HttpOpener, Opener

MiB = 1 << 20


@dataclass
class Env:
    """What every scenario of one dataset shares: the data, the hub, the links."""

    data: BuiltDataset
    dataset: str              # name on the hub
    snapshot: str             # pinned snapshot id
    hub_url: str
    links: dict[str, Service]  # "wide" / "narrow" -> the wan process in front of the hub
    work: Path                # scratch: caches, mount points (removed at the end)
    logs: Path                # service, mount and peer logs (kept with the results)
    cache_size: int
    spoke_reader: str = "auto"  # "auto" (mount, else HTTP), "mount" or "http"
    stage_inflight: int = 64
    epochs: int = 3


@dataclass
class Prepared:
    opener: Opener
    reader: str                                   # what the loop read through, in words
    spoke_url: str | None = None                  # for hit ratio from /metrics
    setup: Callable[[], None] | None = None       # charged to the run (the staged copy)
    wrap_sampler: Callable[[EpochSampler], Sampler[int]] | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Scenario:
    name: str
    uses_link: bool
    prepare: Callable[[Env, str | None], contextlib.AbstractContextManager[Prepared]]
    unavailable: Callable[[], str | None] = lambda: None
    description: str = ""


SCENARIOS: dict[str, Scenario] = {}


def register(s: Scenario) -> Scenario:
    SCENARIOS[s.name] = s
    return s


# -- helpers ---------------------------------------------------------------------------------
def http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10) as r:
        return json.loads(r.read())


def wan_bytes(link: Service) -> int:
    st = http_json(link.control + "/status")
    return int(st["bytes_up"]) + int(st["bytes_down"])


def spoke_counters(spoke_url: str) -> tuple[float, float]:
    """(hits, misses) from the spoke's Prometheus text."""
    with urllib.request.urlopen(spoke_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {"spokefs_cache_hits_total": 0.0, "spokefs_cache_misses_total": 0.0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in found:
            found[name] = float(value)
    return found["spokefs_cache_hits_total"], found["spokefs_cache_misses_total"]


@contextlib.contextmanager
def cold_spoke(upstream: str, cache: Path, cache_size: int, log_path: Path,
               *extra: str) -> Iterator[Service]:
    """A started spoke behind ``upstream`` on an empty ``cache`` folder (removed after);
    ``extra``: more ``spokefs spoke serve`` arguments."""
    shutil.rmtree(cache, ignore_errors=True)  # every scenario starts cold
    spoke = Service(spoke_args(upstream, cache, str(cache_size), 0, *extra), log_path=log_path)
    spoke.start()
    try:
        yield spoke
    finally:
        spoke.stop()
        shutil.rmtree(cache, ignore_errors=True)


@contextlib.contextmanager
def spoke_service(env: Env, upstream: str, tag: str) -> Iterator[Service]:
    with cold_spoke(upstream, env.work / f"{tag}-cache", env.cache_size,
                    env.logs / f"{tag}-spoke.log") as spoke:
        yield spoke


@contextlib.contextmanager
def through_spoke(env: Env, link: str | None, tag: str) -> Iterator[Prepared]:
    """A cold spoke whose upstream is the link; read through ``spokefs mount`` on it (the
    point: unchanged training code), or over HTTP when the mount cannot run here."""
    assert link is not None
    tag = f"{env.data.spec.shape}-{tag}"
    with spoke_service(env, env.links[link].url, tag) as spoke, contextlib.ExitStack() as stack:
        prepared: Prepared | None = None
        notes: list[str] = []
        if env.spoke_reader != "http":
            mp = env.work / f"{tag}-mnt"
            try:
                stack.enter_context(spokefs_mount(f"{spoke.url}/{env.dataset}@{env.snapshot}",
                                                  mp, env.logs / f"{tag}-mount.log"))
                prepared = Prepared(FileOpener(mp, "spokefs mount (FUSE) -> spoke"), "mount",
                                    spoke.url, notes=notes)
            except RuntimeError as exc:
                if env.spoke_reader == "mount":
                    raise
                notes.append(f"{exc}; fell back to HTTP reads through the spoke")
        if prepared is None:
            prepared = Prepared(HttpOpener(spoke.url, env.dataset, env.snapshot,
                                           "ranged GET per sample -> spoke"),
                                "http", spoke.url, notes=notes)
        yield prepared


# -- the scenarios ---------------------------------------------------------------------------
@contextlib.contextmanager
def _local(env: Env, link: str | None) -> Iterator[Prepared]:
    """The folder the hub serves, read directly: the data on this host's disk, the pace the
    loop keeps when storage is not in the way."""
    yield Prepared(FileOpener(env.data.root, "the hub's source folder on this host"), "folder")


@contextlib.contextmanager
def _local_http(env: Env, link: str | None) -> Iterator[Prepared]:
    yield Prepared(HttpOpener(env.hub_url, env.dataset, env.snapshot,
                              "ranged GET per sample -> hub (no link)"), "http-hub")


@contextlib.contextmanager
def _remote_direct(env: Env, link: str | None) -> Iterator[Prepared]:
    assert link is not None
    yield Prepared(HttpOpener(env.links[link].url, env.dataset, env.snapshot,
                              "ranged GET per sample -> link -> hub"), "http-link")


@contextlib.contextmanager
def _remote_spoke(env: Env, link: str | None) -> Iterator[Prepared]:
    with through_spoke(env, link, f"spoke-{link}") as p:
        yield p


def _hints_unavailable() -> str | None:
    try:
        mod = importlib.import_module("spokefs.torch")
    except ImportError as exc:
        return f"spokefs.torch is not importable ({exc})"
    if not hasattr(mod, "AnnouncingSampler"):
        return "spokefs.torch has no AnnouncingSampler"
    return None


@contextlib.contextmanager
def _remote_spoke_hints(env: Env, link: str | None) -> Iterator[Prepared]:
    """remote_spoke, the loop's sampler wrapped in ``spokefs.torch.AnnouncingSampler``: each
    epoch's order (and, for shards, each sample's byte range) goes to the spoke first."""
    from spokefs.torch import AnnouncingSampler

    with through_spoke(env, link, f"hints-{link}") as p:
        url = f"{p.spoke_url}/{env.dataset}@{env.snapshot}"
        ix = env.data.index
        ranges = None
        if env.data.spec.shape == "shards":
            def ranges(i: int) -> tuple[int, int]:
                return ix.offsets[i], ix.sizes[i]
        p.wrap_sampler = lambda s: AnnouncingSampler(s, paths=ix.paths, url=url,
                                                     job="bench-train", ranges=ranges)
        p.reader += "+hints"
        yield p


@contextlib.contextmanager
def _staged(env: Env, link: str | None) -> Iterator[Prepared]:
    assert link is not None
    dest = env.work / "staged"
    shutil.rmtree(dest, ignore_errors=True)
    base = env.links[link].url

    def copy() -> None:
        asyncio.run(stage_copy(base, env.dataset, env.snapshot, dest, env.stage_inflight))
    try:
        yield Prepared(FileOpener(dest, f"local files after a copy over the link "
                                  f"({env.stage_inflight} ranged GETs in flight)"),
                       "staged", setup=copy)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


async def stage_copy(base: str, dataset: str, snapshot: str, dest: Path, inflight: int,
                     chunk: int = 8 * MiB) -> int:
    """Copy a snapshot over the link: its manifest, then every file in ranged GETs of
    ``chunk`` bytes, ``inflight`` at once. Returns the bytes copied."""
    import aiohttp

    from spokefs.manifest import Manifest

    prefix = f"{base.rstrip('/')}/{dataset}@{snapshot}/"
    sem = asyncio.Semaphore(inflight)
    fds: dict[str, int] = {}

    async def get(http: aiohttp.ClientSession, f: str, lo: int, hi: int) -> None:
        async with sem, http.get(prefix + f, headers={"Range": f"bytes={lo}-{hi - 1}"}) as r:
            if r.status != 206:
                raise OSError(f"staging {f}: HTTP {r.status}")
            pos = lo
            async for part in r.content.iter_chunked(MiB):
                os.pwrite(fds[f], part, pos)
                pos += len(part)
            if pos != hi:
                raise OSError(f"staging {f}: got {pos - lo} bytes of {hi - lo}")

    conn = aiohttp.TCPConnector(limit=inflight)
    async with aiohttp.ClientSession(connector=conn, auto_decompress=False) as http:
        url = f"{base.rstrip('/')}/v1/datasets/{dataset}/snapshots/{snapshot}/manifest"
        async with http.get(url) as r:
            r.raise_for_status()
            manifest = Manifest.decode(await r.read())
        try:
            for e in manifest.entries():
                (dest / e.path).parent.mkdir(parents=True, exist_ok=True)
                fds[e.path] = os.open(dest / e.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                      0o644)
                os.ftruncate(fds[e.path], e.size)
            await asyncio.gather(*(get(http, e.path, lo, min(e.size, lo + chunk))
                                   for e in manifest.entries()
                                   for lo in range(0, e.size, chunk)))
        finally:
            for fd in fds.values():
                os.close(fd)
    return manifest.total_bytes


def _rclone_unavailable() -> str | None:
    if shutil.which("rclone") is None:
        return "rclone is not installed"
    return fuse_unusable(need_pyfuse3=False)


@contextlib.contextmanager
def _rclone(env: Env, link: str | None) -> Iterator[Prepared]:
    """rclone's HTTP remote with its full VFS cache, mounted as a user would mount it."""
    assert link is not None
    mp, cache = env.work / "rclone-mnt", env.work / "rclone-cache"
    shutil.rmtree(cache, ignore_errors=True)
    mp.mkdir(parents=True, exist_ok=True)
    conf = env.work / "rclone.conf"
    conf.touch()
    log = env.logs / f"{env.data.spec.shape}-rclone.log"
    cmd = ["rclone", "mount", ":http:", str(mp), "--http-url",
           f"{env.links[link].url}/{env.dataset}/", "--vfs-cache-mode", "full", "--read-only",
           "--cache-dir", str(cache), "--config", str(conf), "--log-file", str(log)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        try:
            wait_mounted(mp, proc, 30)
        except MountError as exc:
            raise RuntimeError(f"rclone mount did not come up ({exc}); see {log}") from None
        version = subprocess.run(["rclone", "version"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[:1]
        yield Prepared(FileOpener(mp, f"rclone mount :http: --vfs-cache-mode full "
                                  f"({' '.join(version)})"), "rclone")
    finally:
        with contextlib.suppress(OSError):
            unmount(mp)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(15)
        shutil.rmtree(cache, ignore_errors=True)


def _fsspec_unavailable() -> str | None:
    try:
        import aiohttp  # noqa: F401  (fsspec's HTTP filesystem needs it)
        import fsspec  # noqa: F401
    except ImportError as exc:
        return f"fsspec's HTTP filesystem is not installed ({exc})"
    return None


@contextlib.contextmanager
def _fsspec_cache(env: Env, link: str | None) -> Iterator[Prepared]:
    assert link is not None
    import fsspec

    cache = env.work / "fsspec-cache"
    shutil.rmtree(cache, ignore_errors=True)
    try:
        yield Prepared(FsspecOpener(env.links[link].url, env.dataset, cache,
                                    f"fsspec {fsspec.__version__} simplecache::http"),
                       "fsspec")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


register(Scenario("local", False, _local,
                  description="the hub's folder on this host, read directly"))
register(Scenario("local_http", False, _local_http,
                  description="the hub on this host over HTTP, no link"))
register(Scenario("remote_direct", True, _remote_direct,
                  description="over the link to the hub, no cache"))
register(Scenario("remote_spoke", True, _remote_spoke,
                  description="through a cold spoke behind the link"))
register(Scenario("remote_spoke_hints", True, _remote_spoke_hints, _hints_unavailable,
                  description="the same, spokefs.torch.AnnouncingSampler announcing the order"))
register(Scenario("staged", True, _staged,
                  description="parallel copy over the link first, then local reads"))
register(Scenario("rclone", True, _rclone, _rclone_unavailable,
                  description="rclone mount :http: with its full VFS cache"))
register(Scenario("fsspec_cache", True, _fsspec_cache, _fsspec_unavailable,
                  description="fsspec simplecache over its HTTP filesystem"))
