"""``mount.fuse.spokefs``: the helper mount(8) runs for an /etc/fstab line of type
``fuse.spokefs``, and for ``mount -t fuse.spokefs URL DIR``::

    # /etc/fstab
    http://spoke:8471/imagenet  /mnt/imagenet  fuse.spokefs  allow_other,deadline=60s,_netdev  0 0

mount(8) calls ``mount.fuse.spokefs SOURCE MOUNTPOINT -o OPTS`` (it looks in /sbin: link
the installed script there). This turns that into ``spokefs mount SOURCE MOUNTPOINT -o
OPTS`` (see ``spokefs.mount.options`` for the ``-o`` names), which returns once the mount
answers and leaves it running in the background. Options that belong before the command go
there: ``token_file=FILE`` (a boot has no ``SPOKEFS_TOKEN``), ``ca_bundle=FILE``,
``log_format=json``, ``log_level=LEVEL``; and ``config=FILE`` reads a spokefs config file.
Exit status as mount(8) documents it for helpers: 0 mounted, 1 a wrong invocation, 32 the
mount failed.
"""

from __future__ import annotations

import argparse
import sys

from spokefs.mount.options import split

# Options of ``spokefs`` itself (before the command), by -o name.
GLOBAL = {"token_file": "--token-file", "ca_bundle": "--ca-bundle",
          "log_format": "--log-format", "log_level": "--log-level"}
USAGE_ERROR, MOUNT_FAILED = 1, 32


def command(argv: list[str]) -> list[str] | None:
    """The ``spokefs`` arguments for the helper's ``argv`` (None: ``-f``, a fake mount)."""
    p = argparse.ArgumentParser(prog="mount.fuse.spokefs",
                                description="mount(8)'s helper for fuse.spokefs: runs "
                                "`spokefs mount SOURCE MOUNTPOINT -o OPTS`")
    p.add_argument("source", metavar="SOURCE", help="http://HOST:PORT/DATASET[@SNAPSHOT]")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTS")
    p.add_argument("-v", dest="verbose", action="count", default=0)
    p.add_argument("-f", dest="fake", action="store_true", help="do everything but mount")
    # mount(8) may pass these; they change nothing here.
    p.add_argument("-n", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-s", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-t", help=argparse.SUPPRESS)
    p.add_argument("-N", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.fake:
        return None
    head = ["-v"] * a.verbose
    tail: list[str] = []
    rest = []
    for key, value in split(a.options):
        name = key.replace("-", "_")
        if name in GLOBAL and value is not None:
            head += [GLOBAL[name], value]
        elif name == "config" and value is not None:
            tail += ["--config", value]
        else:
            rest.append(key if value is None else f"{key}={value}")
    if rest:
        tail += ["-o", ",".join(rest)]
    return [*head, "mount", a.source, a.mountpoint, *tail]


def main(argv: list[str] | None = None) -> int:
    try:
        args = command(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse said what is wrong
        return 0 if exc.code == 0 else USAGE_ERROR
    if args is None:
        return 0
    from spokefs.cli import main as spokefs

    try:
        code = spokefs(args)
    except SystemExit as exc:  # a usage error of spokefs mount
        return 0 if exc.code == 0 else USAGE_ERROR
    return 0 if code == 0 else MOUNT_FAILED


if __name__ == "__main__":
    sys.exit(main())
