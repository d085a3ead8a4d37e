"""``spokefs mount`` and ``spokefs umount``."""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from spokefs.errors import ConfigError
from spokefs.mount.options import apply_o, parse_mode
from spokefs.units import parse_duration, parse_size

if TYPE_CHECKING:
    from spokefs.mount.run import MountOptions


def register(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "mount", help="mount a dataset snapshot as a read-only folder (FUSE)",
        description="Mount one snapshot of a dataset as an ordinary read-only folder, so "
        "training code reads it with open() and read(). The snapshot is resolved once at "
        "start (URL without @SNAPSHOT = the latest) and stays pinned. File listings and "
        "stat come from the snapshot's manifest and never cross the network; reads go to "
        "the spoke or hub in the URL, or through a cache inside this process with "
        "--cache-dir. Without --foreground the command returns once the mount works. "
        "/etc/fstab and `mount -t fuse.spokefs URL DIR` run it through mount.fuse.spokefs "
        "(docs/mount.md). A URL without a dataset mounts the namespace: a folder per "
        "dataset the token may read, each pinned to its latest snapshot when first entered.",
        epilog="examples:\n"
        "  spokefs mount http://127.0.0.1:8471/imagenet /mnt/imagenet\n"
        "  spokefs mount http://hub:8470/imagenet@3fa9c1d20b7e /mnt/in --cache-dir /nvme/c "
        "--cache-size 500GiB\n"
        "  spokefs mount http://spoke:8471/imagenet /mnt/in -o allow_other,uid=1000,"
        "file_mode=0440\n"
        "  spokefs mount http://spoke:8471/ /mnt/data --pin imagenet@3fa9c1d20b7e\n"
        "  spokefs umount /mnt/imagenet",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("url", metavar="URL",
                   help="http://HOST:PORT/DATASET[@SNAPSHOT] on a spoke (usual) or a hub; "
                   "http://HOST:PORT/ mounts every dataset the token may read, each a folder")
    m.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path,
                   help="an existing empty folder")
    m.add_argument("--cache-dir", type=Path,
                   help="embed a block cache in this process, kept in this folder (single-node "
                   "use without a spoke service); needs --cache-size")
    m.add_argument("--cache-size", type=parse_size,
                   help="hard bound on the embedded cache, e.g. 200GiB")
    m.add_argument("-f", "--foreground", action="store_true",
                   help="stay in the foreground and log to stderr (Ctrl-C unmounts)")
    m.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (non-root needs user_allow_other in "
                   "/etc/fuse.conf)")
    m.add_argument("--deadline", type=parse_duration, default=30.0,
                   help="a read the upstream cannot answer for this long fails with EIO "
                   "instead of hanging (default 30s)")
    m.add_argument("--read-ahead-kb", type=int, default=None, metavar="KB",
                   help="kernel readahead of the mount in KiB; sets the size of the reads the "
                   "kernel asks for (default 4096; needs root, else the kernel's 128)")
    m.add_argument("--no-short-circuit", action="store_true",
                   help="read everything over HTTP, even on the spoke's own host (by default "
                   "the mount reads resident blocks from the spoke's cache files, checking "
                   "every byte, when it can read them)")
    m.add_argument("--spoke-cache", type=Path, metavar="DIR",
                   help="the spoke's cache folder on this host, for the short circuit (by "
                   "default the folder the spoke's status names, which it shows only to an "
                   "admin token or without --auth)")
    m.add_argument("--uid", type=int, metavar="UID",
                   help="the owner every file and folder shows (default: the user who mounts)")
    m.add_argument("--gid", type=int, metavar="GID",
                   help="the group every file and folder shows (default: the mounting user's)")
    m.add_argument("--file-mode", type=parse_mode, metavar="MODE",
                   help="permission bits of every file, in octal, e.g. 0444 (default: each "
                   "file's own from the snapshot, without setuid, setgid or sticky)")
    m.add_argument("--dir-mode", type=parse_mode, metavar="MODE",
                   help="permission bits of every folder, in octal (default 0555)")
    m.add_argument("-o", dest="options", action="append", metavar="OPT[,OPT...]",
                   help="mount options as mount(8) gives them: allow_other, ro, uid=N, "
                   "gid=N, file_mode=M, dir_mode=M, noexec; any option above as key=value "
                   "(deadline=60s, engine=python, no_short_circuit); fstab's own (defaults, "
                   "rw, auto, noauto, user, nofail, _netdev, x-*) are ignored")
    m.add_argument("--pin", action="append", metavar="DATASET@SNAPSHOT",
                   help="a namespace mount (URL without a dataset): show DATASET at this "
                   "snapshot (repeat for more; else each is pinned to its latest when its "
                   "folder is first entered, for as long as the mount lives)")
    m.add_argument("--writable", action="store_true",
                   help="let new files be written into a writable dataset (native engine): "
                   "each is uploaded to the spoke when closed or fsynced, and a folder is "
                   "published when its commit marker (.metadata) arrives; the snapshot's own "
                   "files stay read-only (docs/checkpoints.md)")
    m.add_argument("--commit-marker", default=".metadata", metavar="NAME",
                   help="with --writable: the file whose arrival publishes its folder "
                   "(default .metadata, what torch.distributed.checkpoint writes last; "
                   "'' for none: spokefs ckpt commit publishes)")
    m.add_argument("--write-passthrough", choices=("auto", "off"), default="off",
                   help="with --writable: auto lets the kernel write new files straight to "
                   "their staging files (FUSE passthrough; a mount by root on Linux 6.13 or "
                   "later), so a write costs what a local write does; off (the default, until "
                   "writes through a descriptor still open after the commit and shared-mmap "
                   "writes are handled) sends every write through the mount "
                   "(docs/checkpoints.md)")
    m.add_argument("--engine", choices=("auto", "native", "python"), default="auto",
                   help="what serves the mount: native (a Rust FUSE daemon; plain http, no "
                   "--cache-dir), python (pyfuse3; everything), or auto (native when it can, "
                   "else python; the default, or SPOKEFS_MOUNT_ENGINE). The log says which")
    m.add_argument("--log-file", type=Path,
                   help="where a background mount logs (default "
                   "~/.local/state/spokefs/mount/NAME-HASH.log)")
    m.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the mount's own Prometheus metrics (EIO count, FUSE request "
                   "latency by kind) at http://ADDR:PORT/metrics; off by default; 0 picks a "
                   "free port, which the ready line names")
    m.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="the address --metrics-port listens on (default 127.0.0.1: this "
                   "host only; the endpoint asks for no token)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # set by the daemoniser
    m.set_defaults(func=functools.partial(_mount, m))

    u = sub.add_parser(
        "umount", help="unmount a spokefs mount (also a dead one)",
        description="Detach a mount lazily (fusermount3 -u -z, else umount -l): works while "
        "files are open, and clears a mount whose process died ('Transport endpoint is not "
        "connected'). A live mount process exits by itself once unmounted.")
    u.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    u.set_defaults(func=_umount)


def _mount(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from spokefs.mount.run import DEFAULT_READ_AHEAD_KB, MountOptions

    extra = apply_o(parser, args, args.options or [])
    if (args.cache_dir is None) != (args.cache_size is None):
        raise ConfigError("--cache-dir and --cache-size go together (embedded cache)")
    if args.deadline <= 0:
        raise ConfigError("--deadline must be positive")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {args.metrics_port}: a port is 0 to 65535")
    opts = MountOptions(url=args.url, mountpoint=args.mountpoint, cache_dir=args.cache_dir,
                        cache_size=args.cache_size or 0, deadline=args.deadline,
                        allow_other=args.allow_other,
                        read_ahead_kb=args.read_ahead_kb or DEFAULT_READ_AHEAD_KB,
                        short_circuit=not args.no_short_circuit,
                        spoke_cache=args.spoke_cache, engine=args.engine, writable=args.writable,
                        commit_marker=args.commit_marker or None,
                        write_passthrough=args.write_passthrough == "auto", uid=args.uid,
                        gid=args.gid, file_mode=args.file_mode, dir_mode=args.dir_mode,
                        extra_options=tuple(extra), pins=tuple(args.pin or ()),
                        metrics_port=args.metrics_port, metrics_addr=args.metrics_addr)
    from spokefs.mount.source import Target

    if opts.cache_dir is not None and Target.parse(opts.url).namespace:
        raise ConfigError("--cache-dir embeds the cache of one dataset; name it in the URL "
                          "(http://HOST:PORT/DATASET), or mount the namespace of a spoke")
    if opts.pins and not Target.parse(opts.url).namespace:
        raise ConfigError("--pin is for a namespace mount (a URL without a dataset); name "
                          "the snapshot in the URL instead: http://HOST:PORT/DATASET@SNAPSHOT")
    if opts.pins:
        from spokefs.mount.run import parse_pins

        parse_pins(opts.pins)  # a bad pin fails here, before a background mount starts
    if not args.foreground:
        return _daemonise(args)
    return _foreground(opts, args.ready_fd)


def _foreground(opts: MountOptions, ready_fd: int | None) -> int:
    from spokefs.mount.run import serve

    def on_ready(message: str) -> None:
        print(message, flush=True)
        if ready_fd is not None:  # tell the waiting parent, then let go of its pipe
            os.write(ready_fd, (message + "\n").encode())
            os.close(ready_fd)

    asyncio.run(serve(opts, on_ready))
    return 0


def _default_log(mountpoint: Path) -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    where = str(mountpoint.absolute())
    tag = hashlib.blake2b(where.encode(), digest_size=4).hexdigest()
    return state / "spokefs" / "mount" / f"{mountpoint.absolute().name or 'root'}-{tag}.log"


def child_command(argv: list[str], ready_fd: int) -> list[str]:
    """The background mount's child: this very command line, in the foreground, telling
    ``ready_fd`` when it is ready. Whole, so every option reaches it (flags, and the
    environment and --config file it inherits), however many are added later."""
    from spokefs.procs import cli

    extra = ["--foreground", "--ready-fd", str(ready_fd)]
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--" all is positional
    return cli(*argv[:cut], *extra, *argv[cut:])


def _daemonise(args: argparse.Namespace) -> int:
    """Run the mount as a detached child and return once it says it is ready."""
    log_file = args.log_file or _default_log(args.mountpoint)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    argv = getattr(args, "_argv", None)
    r, w = os.pipe()
    cmd = child_command(sys.argv[1:] if argv is None else argv, w)
    with open(log_file, "ab") as log:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 pass_fds=(w,), start_new_session=True)
    os.close(w)
    with os.fdopen(r, "rb") as ready:
        message = ready.readline().decode().strip()  # EOF: the child exited (or closed it)
    if message:
        print(f"{message} (pid {child.pid}, log {log_file})")
        return 0
    code = child.wait()
    tail = _tail(log_file)
    print(f"spokefs: error: mount exited with status {code}; last log lines:\n{tail}",
          file=sys.stderr)
    return code or 1


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _umount(args: argparse.Namespace) -> int:
    from spokefs.mount.process import unmount

    t0 = time.monotonic()
    try:
        done = unmount(args.mountpoint)
    except OSError as exc:
        print(f"spokefs: error: cannot unmount {args.mountpoint}: {exc.strerror}",
              file=sys.stderr)
        return 1
    if not done:
        print(f"spokefs: {args.mountpoint} is not mounted", file=sys.stderr)
        return 1
    print(f"unmounted {args.mountpoint} ({time.monotonic() - t0:.2f}s)")
    return 0
