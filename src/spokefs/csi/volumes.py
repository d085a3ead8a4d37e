"""The node driver's volumes: what a publish asks for, one mount process per published target,
and the folder that remembers them across restarts of the driver. No gRPC here
(``service.py`` maps the errors below to status codes).

A publish starts ``spokefs mount --foreground`` as a process of its own session, logging to a
file in the state folder, and returns once the mount says it is ready. The process does not
depend on the driver: it keeps serving when the driver exits, crashes or is replaced, so
upgrading the driver or publishing another volume disturbs no volume. Each published target
has a record (``STATE/volumes/KEY.json``, KEY a digest of the target path) written before the
process starts; a driver that starts reads them back: a live mount is adopted as it is, and a
dead one (its process killed) is cleared and mounted again at the same target, so new opens
there work again. Unpublish detaches the mount lazily (``spokefs umount``'s way), waits for
the process to exit, and removes the target folder and the record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spokefs.errors import (
    ConfigError,
    Forbidden,
    NotFound,
    SpokeError,
    Unauthorized,
    UpstreamUnavailable,
)
from spokefs.mount import sysfs
from spokefs.mount.process import READY_PREFIX, unmount
from spokefs.procs import cli
from spokefs.units import parse_duration
from spokefs.wire.auth import ENV_TOKEN, ENV_TOKEN_FILE
from spokefs.wire.paths import NAME

log = logging.getLogger(__name__)

# Volume attributes (a PersistentVolume's spec.csi.volumeAttributes, an inline volume's
# volumeAttributes) spokefs reads; the kubelet adds its own under csi.storage.k8s.io/.
ATTRIBUTES = ("dataset", "snapshot", "spokeUrl", "deadline")
NAMESPACE = "*"  # the 'dataset' of a volume that mounts the whole namespace
KUBERNETES_PREFIX = "csi.storage.k8s.io/"
TOKEN_KEY = "token"  # the key of nodePublishSecretRef's Secret that holds a read token


class CsiError(Exception):
    """A request that cannot be carried out; ``code`` is its gRPC status code's name."""

    code = "INTERNAL"


class InvalidArgument(CsiError):
    code = "INVALID_ARGUMENT"


class VolumeNotFound(CsiError):
    code = "NOT_FOUND"


class AlreadyExists(CsiError):
    code = "ALREADY_EXISTS"


class Aborted(CsiError):
    code = "ABORTED"


class FailedPrecondition(CsiError):
    code = "FAILED_PRECONDITION"


class Unavailable(CsiError):
    code = "UNAVAILABLE"


class PermissionDenied(CsiError):
    code = "PERMISSION_DENIED"


@dataclass(frozen=True)
class VolumeSpec:
    """What a NodePublishVolume asks for, checked. ``url`` is the mount's URL."""

    volume_id: str
    target: str
    spoke: str
    dataset: str
    snapshot: str
    deadline: str
    options: tuple[str, ...]
    token: str | None = field(default=None, repr=False, compare=False)  # never logged

    @property
    def namespace(self) -> bool:
        return self.dataset == NAMESPACE

    @property
    def url(self) -> str:
        if self.namespace:  # every dataset the token may read, a folder each
            return f"{self.spoke}/"
        return f"{self.spoke}/{self.dataset}" + (f"@{self.snapshot}" if self.snapshot else "")


def parse_request(volume_id: str, target: str, context: Mapping[str, str],
                  secrets: Mapping[str, str], *, block: bool, mount_flags: list[str],
                  default_spoke: str | None, capability: bool = True) -> VolumeSpec:
    """Check a publish's arguments; InvalidArgument names the field or attribute at fault."""
    if not volume_id:
        raise InvalidArgument("volume_id is required")
    if not target:
        raise InvalidArgument("target_path is required")
    if not os.path.isabs(target) or os.path.normpath(target) != target.rstrip("/"):
        raise InvalidArgument(f"target_path {target!r} must be an absolute, normalised path")
    if not capability:
        raise InvalidArgument("volume_capability is required")
    if block:
        raise InvalidArgument("volume_capability: block access is not supported (spokefs "
                              "volumes are read-only filesystems: use a mount capability)")
    unknown = sorted(k for k in context if k not in ATTRIBUTES
                     and not k.startswith(KUBERNETES_PREFIX))
    if unknown:
        raise InvalidArgument(f"unknown volume attribute {unknown[0]!r} (spokefs reads "
                              f"{', '.join(ATTRIBUTES)})")
    dataset = context.get("dataset", "")
    if not dataset:
        raise InvalidArgument("volume attribute 'dataset' is required (the dataset's name, "
                              f"or {NAMESPACE!r} for every dataset the token may read)")
    if dataset == NAMESPACE:
        if context.get("snapshot"):
            raise InvalidArgument(f"volume attribute 'snapshot': a namespace volume (dataset "
                                  f"{NAMESPACE!r}) pins each dataset when first entered; "
                                  "name one dataset to pin a snapshot")
    elif not NAME.fullmatch(dataset):
        raise InvalidArgument(f"volume attribute 'dataset': invalid name {dataset!r} (letters, "
                              "digits, '.', '_', '-')")
    snapshot = context.get("snapshot", "")
    if snapshot and not NAME.fullmatch(snapshot):
        raise InvalidArgument(f"volume attribute 'snapshot': invalid id {snapshot!r}")
    spoke = (context.get("spokeUrl") or default_spoke or "").rstrip("/")
    if not spoke:
        raise InvalidArgument("volume attribute 'spokeUrl' is required (the driver has no "
                              "--spoke-url)")
    scheme, sep, rest = spoke.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
        raise InvalidArgument(f"volume attribute 'spokeUrl': {spoke!r} is not "
                              "http(s)://HOST:PORT")
    deadline = context.get("deadline", "")
    if deadline:
        try:
            if parse_duration(deadline) <= 0:
                raise ConfigError("not positive")
        except ConfigError:
            raise InvalidArgument(f"volume attribute 'deadline': {deadline!r} is not a "
                                  "positive duration (e.g. 30s, 2m)") from None
    token = secrets.get(TOKEN_KEY) or None
    extra = set(secrets) - {TOKEN_KEY}
    if extra:  # the keys only: a secret's values are never shown
        raise InvalidArgument(f"the volume's secret has keys spokefs does not read "
                              f"({', '.join(sorted(extra))}); it reads {TOKEN_KEY!r}")
    for flag in mount_flags:
        if not flag or any(c.isspace() for c in flag):
            raise InvalidArgument(f"volume_capability mount_flags: bad option {flag!r}")
    return VolumeSpec(volume_id, target.rstrip("/"), spoke, dataset, snapshot, deadline,
                      tuple(mount_flags), token.strip() if token else None)


@dataclass
class Record:
    """A published target, as kept in the state folder."""

    volume_id: str
    target: str
    url: str
    deadline: str
    options: list[str]
    own_token: bool
    pid: int = 0
    started: str = ""      # the process's start time (/proc/PID/stat), against pid reuse

    def same_volume(self, spec: VolumeSpec) -> bool:
        return (self.volume_id, self.url, self.deadline, tuple(self.options)) == (
            spec.volume_id, spec.url, spec.deadline, spec.options)


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


class Volumes:
    """The published targets of one node, their mount processes and their records."""

    def __init__(self, state_dir: Path, default_spoke: str | None = None,
                 mount_timeout: float = 60.0, preflight_timeout: float = 15.0) -> None:
        self.state_dir = state_dir
        self.records_dir = state_dir / "volumes"
        self.records_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state_dir, 0o700)  # token files live here
        self.default_spoke = default_spoke.rstrip("/") if default_spoke else None
        self.mount_timeout = mount_timeout
        self.preflight_timeout = preflight_timeout
        self._busy: set[str] = set()
        self._busy_lock = threading.Lock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # started here: reaped here

    # -- the state folder ----------------------------------------------------------------
    def _key(self, target: str) -> str:
        return hashlib.blake2b(target.encode(), digest_size=10).hexdigest()

    def _path(self, target: str, suffix: str) -> Path:
        return self.records_dir / f"{self._key(target)}{suffix}"

    def load(self, target: str) -> Record | None:
        try:
            return Record(**json.loads(self._path(target, ".json").read_text()))
        except FileNotFoundError:
            return None

    def records(self) -> list[Record]:
        out = []
        for p in sorted(self.records_dir.glob("*.json")):
            try:
                out.append(Record(**json.loads(p.read_text())))
            except (OSError, ValueError, TypeError) as exc:
                log.error("csi: unreadable volume record %s: %s", p, exc)
        return out

    def _save(self, rec: Record) -> None:
        path = self._path(rec.target, ".json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, path)  # a crash leaves the old record or the new one, never half

    def _forget(self, rec: Record) -> None:
        for suffix in (".json", ".token", ".log"):
            with contextlib.suppress(FileNotFoundError):
                self._path(rec.target, suffix).unlink()

    @contextlib.contextmanager
    def _exclusive(self, target: str) -> Iterator[None]:
        """One operation per target at a time; another one meanwhile is ABORTED (the CSI
        answer for 'an operation is pending for this volume': the caller retries)."""
        with self._busy_lock:
            if target in self._busy:
                raise Aborted(f"an operation on {target} is in progress")
            self._busy.add(target)
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy.discard(target)

    # -- processes ------------------------------------------------------------------------
    def alive(self, rec: Record) -> bool:
        if rec.pid <= 0:
            return False
        child = self._children.get(rec.pid)
        if child is not None and child.poll() is not None:
            del self._children[rec.pid]
            return False
        return _start_time(rec.pid) == rec.started

    def serving(self, rec: Record) -> bool:
        return self.alive(rec) and sysfs.is_mounted(rec.target)

    def _env(self, rec: Record) -> dict[str, str]:
        """The mount's environment: the driver's, but for the token. A volume's own token
        (nodePublishSecretRef) is a file in the state folder; the driver's token
        (--token-file) goes only to the driver's own spoke, never to a URL a volume names."""
        env = dict(os.environ)
        if rec.own_token:
            env.pop(ENV_TOKEN, None)
            env[ENV_TOKEN_FILE] = str(self._path(rec.target, ".token"))
        elif self.default_spoke is None or not rec.url.startswith(self.default_spoke + "/"):
            env.pop(ENV_TOKEN, None)
            env.pop(ENV_TOKEN_FILE, None)
        return env

    def _launch(self, rec: Record) -> None:
        """Start the mount process and wait for its ready line; the process is in a session
        of its own, logs to a file, and holds nothing of the driver's (it outlives it)."""
        r, w = os.pipe()
        extra = [f"--deadline={rec.deadline}"] if rec.deadline else []
        for opt in rec.options:
            extra += ["-o", opt]
        cmd = cli("mount", "--foreground", "--ready-fd", str(w), "--allow-other", *extra,
                  rec.url, rec.target)
        log_path = self._path(rec.target, ".log")
        try:
            with open(log_path, "ab") as out:
                child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out, pass_fds=(w,), env=self._env(rec),
                                         start_new_session=True, cwd="/")
        finally:
            os.close(w)
        self._children[child.pid] = child
        try:
            line = _read_line(r, self.mount_timeout)
        finally:
            os.close(r)
        if not line.startswith(READY_PREFIX):
            if child.poll() is None:
                child.kill()
            child.wait()
            self._children.pop(child.pid, None)
            with contextlib.suppress(OSError):
                unmount(rec.target)  # a mount it made before failing is dead now
            why = ("it said nothing for "
                   f"{self.mount_timeout:g}s" if child.returncode == -signal.SIGKILL
                   else f"it exited with status {child.returncode}")
            raise CsiError(f"the mount of {rec.url} at {rec.target} failed ({why}); its last "
                           f"lines:\n{_tail(log_path)}")
        rec.pid = child.pid
        rec.started = _start_time(child.pid) or ""
        log.info("csi: mounted %s at %s (pid %d)", rec.url, rec.target, child.pid)

    def _stop(self, rec: Record, timeout: float = 15.0) -> None:
        """Detach the mount (lazily: a reader still holding a file keeps it until closed)
        and end its process: it exits by itself once unmounted; SIGTERM, then SIGKILL."""
        try:
            unmount(rec.target)
        except OSError as exc:
            raise CsiError(f"cannot unmount {rec.target}: {exc.strerror or exc}") from None
        if not self.alive(rec):
            self._reap(rec.pid)
            return
        end = time.monotonic() + timeout
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec.pid, sig)
                end = time.monotonic() + timeout
            while self.alive(rec) and time.monotonic() < end:
                child = self._children.get(rec.pid)
                if child is not None:  # our own child: wait on it, no polling
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(max(0.0, end - time.monotonic()))
                else:  # another driver's child: nothing to block on but time
                    time.sleep(0.05)
            if not self.alive(rec):
                break
        self._reap(rec.pid)

    def _reap(self, pid: int) -> None:
        child = self._children.pop(pid, None)
        if child is not None:
            child.wait()

    # -- the CSI calls --------------------------------------------------------------------
    def publish(self, spec: VolumeSpec) -> bool:
        """Mount ``spec`` at its target, once: True if a mount was started, False if the same
        volume was already served there (a repeated call succeeds, as CSI requires)."""
        with self._exclusive(spec.target):
            rec = self.load(spec.target)
            if rec is not None and not rec.same_volume(spec):
                raise AlreadyExists(f"{spec.target} is already published for volume "
                                    f"{rec.volume_id} ({rec.url}); unpublish it first")
            if rec is not None and self.serving(rec):
                return False
            if rec is None and sysfs.is_mounted(spec.target):
                raise FailedPrecondition(f"something else is mounted at {spec.target}")
            self._preflight(spec)
            if rec is None:
                rec = Record(spec.volume_id, spec.target, spec.url, spec.deadline,
                             list(spec.options), own_token=spec.token is not None)
            else:  # a record whose process is gone: clear its dead mount, mount again
                self._stop(rec)
            if spec.token is not None:
                token_path = self._path(spec.target, ".token")
                fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(spec.token + "\n")
            rec.pid, rec.started = 0, ""
            self._save(rec)  # before the process: a driver that dies now still finds it
            Path(spec.target).mkdir(mode=0o750, parents=True, exist_ok=True)
            self._launch(rec)
            self._save(rec)
            return True

    def unpublish(self, volume_id: str, target: str) -> bool:
        """Unmount ``target``: True if something was unmounted; False if it was not
        published (a repeated call succeeds, as CSI requires)."""
        if not volume_id:
            raise InvalidArgument("volume_id is required")
        if not target:
            raise InvalidArgument("target_path is required")
        target = target.rstrip("/") or "/"
        with self._exclusive(target):
            rec = self.load(target)
            if rec is not None and rec.volume_id != volume_id:
                raise VolumeNotFound(f"{target} holds volume {rec.volume_id}, not {volume_id}")
            done = False
            if rec is not None:
                self._stop(rec)
                done = True
            elif sysfs.is_mounted(target) and (sysfs.mount_entry(target) or ("", ""))[1] in (
                    "fuse.spokefs", "fuse"):  # ours, its record lost: still ours to clear
                unmount(target)
                done = True
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(target)  # CSI: the plugin removes the folder it made
            if rec is not None:
                self._forget(rec)
            return done

    def recover(self) -> None:
        """At start: adopt the mounts a previous driver left running; mount again those whose
        process is gone (a crash, a node's reboot left the record), so new opens work."""
        for rec in self.records():
            if self.serving(rec):
                log.info("csi: adopted the mount of %s at %s (pid %d)", rec.url, rec.target,
                         rec.pid)
                continue
            log.warning("csi: the mount of %s at %s is gone; mounting it again", rec.url,
                        rec.target)
            try:
                with self._exclusive(rec.target):
                    self._stop(rec)
                    Path(rec.target).mkdir(mode=0o750, parents=True, exist_ok=True)
                    self._launch(rec)
                    self._save(rec)
            except (CsiError, OSError) as exc:
                # kept: unpublish still finds it and clears what is left
                log.error("csi: cannot mount %s at %s again: %s", rec.url, rec.target, exc)

    def _preflight(self, spec: VolumeSpec) -> None:
        """Ask the spoke for the dataset and snapshot before starting a process, so a wrong
        name is NOT_FOUND and a refused token PERMISSION_DENIED, not a failed mount."""
        from spokefs.client.sync import Client
        from spokefs.wire.auth import FROM_ENV

        token: str | object | None = spec.token
        if token is None:
            own = self.default_spoke is not None and spec.spoke == self.default_spoke
            token = FROM_ENV if own else None
        client = Client(spec.spoke, deadline=self.preflight_timeout,
                        timeout=self.preflight_timeout, token=token)
        what = f"dataset {spec.dataset!r}" + (
            f" snapshot {spec.snapshot!r}" if spec.snapshot else "") + f" at {spec.spoke}"
        if spec.namespace:
            what = f"the datasets at {spec.spoke}"
        try:
            if spec.namespace:
                client.get_json("/v1/datasets")
            else:
                client.resolve(spec.dataset, spec.snapshot or "latest")
        except NotFound as exc:
            raise VolumeNotFound(f"{what}: {exc}") from None
        except (Unauthorized, Forbidden) as exc:
            raise PermissionDenied(f"{what}: {exc} (the volume's token: the key "
                                   f"{TOKEN_KEY!r} of nodePublishSecretRef)") from None
        except UpstreamUnavailable as exc:
            raise Unavailable(f"{what}: {exc}") from None
        except SpokeError as exc:
            raise FailedPrecondition(f"{what}: {exc}") from None


def _read_line(fd: int, timeout: float) -> str:
    """The first line written to ``fd``, or what came before EOF or ``timeout``."""
    end = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").split("\n", 1)[0].strip()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
