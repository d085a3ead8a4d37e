"""A hub's namespace: which datasets it serves, from where, and changing it while it serves.

Datasets come from the command line (``DIR``, repeated ``--dataset NAME=SOURCE``: fixed for
the life of the process) and from ``[datasets.NAME]`` tables of the hub's ``--config`` file,
the same TOML that holds its other settings (``[hub.serve]``)::

    [datasets.imagenet]
    source = "/data/imagenet"          # a folder, or s3://, gs://, az:// BUCKET/PREFIX
    block_size = "4MiB"                # optional: the hub's --block-size
    state_dir = "/var/lib/spokefs/in"  # optional: --state-dir/NAME, else the default
    endpoint = "http://minio:9000"     # optional, object stores: the hub's --endpoint-url
    writable = false                   # optional, folders: takes uploads (hub/uploads.py)

The file's tables are read again on SIGHUP and when the file changes (checked every
``WATCH_EVERY`` seconds): new datasets are opened and scanned off the event loop and appear
once ready, removed ones answer 404 from the next request on, a changed one is replaced.
Readers of the others are not touched. An edit that does not parse, or a dataset that cannot
be opened, changes nothing: the namespace in force stays, and the log says why.
``parse_datasets`` is sans-I/O; the rest reads files and opens ledgers.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs.errors import ConfigError
from spokefs.filestamp import Stamp, file_stamp
from spokefs.hub.snapshot import ScanResult, SnapshotLedger
from spokefs.origin.base import is_store_url
from spokefs.units import parse_size
from spokefs.wire.paths import check_dataset_name

log = logging.getLogger(__name__)

WATCH_EVERY = 2.0   # seconds between looks at the config file
OPEN_THREADS = 4    # datasets opened and scanned at once (SQLite and fsync release the GIL)
KEYS = {"source", "block_size", "state_dir", "endpoint", "writable"}


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """One dataset of the namespace, as configured: equal specs are the same dataset."""

    name: str
    source: str                 # a folder's resolved path, or an object store URL
    block_size: int
    state_dir: str | None       # None: the default for its source
    endpoint: str | None
    where: str = ""             # for messages: "--dataset x=..." or "FILE [datasets.x]"
    writable: bool = False      # takes uploads and commits (a folder only)

    @property
    def key(self) -> tuple[object, ...]:
        return (self.name, self.source, self.block_size, self.state_dir, self.endpoint,
                self.writable)


def _source(raw: str, base: Path | None) -> str:
    if is_store_url(raw):
        return raw
    p = Path(raw).expanduser()
    return str((base / p) if base is not None and not p.is_absolute() else p.resolve())


def from_flag(spec: str, block_size: int, state_dir: str | None,
              endpoint: str | None) -> DatasetSpec:
    """``--dataset NAME=SOURCE``."""
    name, sep, source = spec.partition("=")
    if not sep or not name or not source:
        raise ConfigError(f"--dataset {spec!r}: expected NAME=DIR or NAME=s3://BUCKET/PREFIX")
    name = check_dataset_name(name)
    return DatasetSpec(name, _source(source, None), block_size,
                       f"{state_dir}/{name}" if state_dir else None, endpoint,
                       f"--dataset {spec}")


def parse_datasets(doc: dict[str, Any], file: Path, block_size: int, state_dir: str | None,
                   endpoint: str | None) -> list[DatasetSpec]:
    """The ``[datasets.NAME]`` tables of a config file (relative paths: to the file's
    folder); ConfigError naming the file, the table and the key."""
    tables = doc.get("datasets", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"config file {file}: 'datasets' must be tables [datasets.NAME]")
    out = []
    for name, t in tables.items():
        where = f"config file {file} [datasets.{name}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: must be a table")
        try:
            check_dataset_name(name)
        except Exception as exc:
            raise ConfigError(f"{where}: {exc}") from None
        norm = {k.replace("-", "_"): v for k, v in t.items()}
        unknown = sorted(set(norm) - KEYS)
        if unknown:
            raise ConfigError(f"{where}: {unknown[0]!r} is not a dataset setting (those: "
                              f"{', '.join(sorted(KEYS))})")
        for key in ("source", "state_dir", "endpoint"):
            if key in norm and not (isinstance(norm[key], str) and norm[key]):
                raise ConfigError(f"{where}: {key} must be a non-empty string")
        if "source" not in norm:
            raise ConfigError(f"{where}: 'source' is missing (a folder, or s3://, gs://, "
                              "az:// BUCKET/PREFIX)")
        bs = block_size
        if "block_size" in norm:
            raw = norm["block_size"]
            if isinstance(raw, bool) or not isinstance(raw, str | int):
                raise ConfigError(f"{where}: block_size must be a size (\"4MiB\") or bytes")
            try:
                bs = parse_size(str(raw))
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{where}: block_size={raw!r}: {exc}") from None
        writable = norm.get("writable", False)
        if not isinstance(writable, bool):
            raise ConfigError(f"{where}: writable must be true or false")
        if writable and is_store_url(norm["source"]):
            raise ConfigError(f"{where}: writable datasets are folders; {norm['source']} is an "
                              "object store")
        sdir = norm.get("state_dir")
        if sdir is not None:
            sdir = _source(sdir, file.parent)
        elif state_dir:
            sdir = f"{state_dir}/{name}"
        out.append(DatasetSpec(name, _source(norm["source"], file.parent), bs, sdir,
                               norm.get("endpoint", endpoint), where, writable))
    return out


def read_config(file: Path, block_size: int, state_dir: str | None,
                endpoint: str | None) -> list[DatasetSpec]:
    try:
        doc = tomllib.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {file}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {file}: not valid TOML: {exc}") from exc
    return parse_datasets(doc, file, block_size, state_dir, endpoint)


def open_dataset(spec: DatasetSpec, show_progress: bool = False
                 ) -> tuple[SnapshotLedger, ScanResult]:
    """The dataset's ledger, opened and scanned (blocking: a thread)."""
    from spokefs.hub.backend import open_state
    from spokefs.hub.bucket import open_bucket

    try:
        st: SnapshotLedger
        if is_store_url(spec.source):
            st = open_bucket(spec.source, spec.name, spec.state_dir, spec.block_size,
                             spec.endpoint)
        else:
            st = open_state(spec.source, spec.name, spec.state_dir, spec.block_size,
                            spec.writable)
    except ConfigError as exc:
        raise ConfigError(f"{spec.where}: {exc}" if spec.where else str(exc)) from None
    try:
        return st, st.scan(show_progress=show_progress)
    except BaseException:
        st.close()
        raise


def open_all(specs: list[DatasetSpec], show_progress: bool = False
             ) -> list[tuple[SnapshotLedger, ScanResult]]:
    """Every spec opened and scanned, a few at once; on any failure none stays open."""
    if len(specs) <= 1:
        return [open_dataset(s, show_progress) for s in specs]
    with ThreadPoolExecutor(OPEN_THREADS) as pool:
        futures = [pool.submit(open_dataset, s) for s in specs]
        done, failed = [], None
        for f in futures:
            try:
                done.append(f.result())
            except BaseException as exc:  # kept to raise once the others are closed
                failed = failed or exc
    if failed is not None:
        for st, _ in done:
            st.close()
        raise failed
    return done


def check_names(specs: list[DatasetSpec]) -> None:
    seen: dict[str, DatasetSpec] = {}
    for s in specs:
        if s.name in seen:
            raise ConfigError(f"{s.where}: a second dataset named {s.name!r} (also "
                              f"{seen[s.name].where})")
        seen[s.name] = s


class Namespace:
    """The datasets a hub serves: the fixed ones and those of the config file, kept in step
    with the file (``reload``). ``backend``: a ``HubBackend``."""

    def __init__(self, backend: Any, fixed: list[DatasetSpec], file: Path | None,
                 defaults: tuple[int, str | None, str | None],
                 report: Callable[[SnapshotLedger, ScanResult], None] | None = None) -> None:
        self.backend = backend
        self.fixed = fixed
        self.file = file
        self.defaults = defaults
        self.report = report
        self.specs: dict[str, DatasetSpec] = {}      # the config file's, in force
        self._stamp: Stamp | None = None
        self._lock = asyncio.Lock()                   # one reload at a time
        self._tasks: set[asyncio.Task[bool]] = set()

    def _stat(self) -> Stamp | None:
        return file_stamp(self.file) if self.file is not None else None

    def initial(self) -> list[tuple[SnapshotLedger, ScanResult]]:
        """The first namespace, before serving: any error stops the hub (blocking)."""
        self._stamp = self._stat()
        from_file = read_config(self.file, *self.defaults) if self.file is not None else []
        check_names([*self.fixed, *from_file])
        opened = open_all([*self.fixed, *from_file], show_progress=True)
        self.specs = {s.name: s for s in from_file}
        return opened

    async def reload(self) -> bool:
        """Bring the namespace in step with the config file; whether it changed. Never
        raises: a file that cannot be used keeps what is in force, and says why."""
        if self.file is None:
            return False
        async with self._lock:
            self._stamp = self._stat()
            try:
                specs = await asyncio.to_thread(read_config, self.file, *self.defaults)
                check_names([*self.fixed, *specs])
            except ConfigError as exc:
                log.error("hub namespace: keeping the %d datasets in force; %s",
                          len(self.backend.states), exc)
                return False
            want = {s.name: s for s in specs}
            gone = [n for n, s in self.specs.items() if n not in want or want[n].key != s.key]
            new = [s for n, s in want.items() if n not in self.specs
                   or self.specs[n].key != s.key]
            if not gone and not new:
                return False
            try:  # off the event loop: a big folder's first scan takes its time
                opened = await asyncio.to_thread(open_all, new)
            except Exception as exc:
                log.error("hub namespace: keeping the %d datasets in force; %s",
                          len(self.backend.states), exc)
                return False
            for name in gone:
                st = await self.backend.remove(name)
                await asyncio.to_thread(st.close)
                log.info("hub namespace: removed dataset %s", name)
            for st, result in opened:
                self.backend.add(st)
                if self.report is not None:
                    self.report(st, result)
                log.info("hub namespace: added dataset %s from %s", st.name, st.root)
            self.specs = want
            return True

    def request_reload(self) -> None:
        """SIGHUP: a reload as a task of the running loop."""
        task = asyncio.get_running_loop().create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def watch(self) -> None:
        """Reload whenever the file changes (its inode, size or mtime)."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            if self.file is not None and self._stat() != self._stamp:
                await self.reload()
