"""The mount's ``-o OPT[,OPT...]`` options, as mount(8) and /etc/fstab spell them (sans-I/O).

Three kinds:
- the usual FUSE and mount names: ``allow_other``, ``ro`` (always so), ``uid=N``, ``gid=N``,
  ``file_mode=M``, ``dir_mode=M`` (octal), ``noexec`` (passed to the kernel);
- every option of ``spokefs mount`` by its name, ``key=value`` (``deadline=60s``,
  ``engine=python``, ``cache-dir=/nvme/c``), or bare for an on/off one (``no_short_circuit``);
- what mount(8) and fstab pass or keep for themselves, accepted and ignored: ``defaults``,
  ``rw`` (the mount is read-only whatever it says), ``auto``, ``noauto``, ``user``, ``users``,
  ``nouser``, ``owner``, ``group``, ``_netdev``, ``nofail``, ``x-*`` (systemd), ``comment=``,
  and the kernel flags spokefs sets itself or that mean nothing here (``nosuid``, ``nodev``,
  ``suid``, ``dev``, ``exec``, ``async``, ``sync``, the ``atime`` family).

An option given both as a flag (``--uid 5``) and in ``-o`` (``uid=6``) is an error, not a
silent choice; ``-o`` beats the environment and a config file, as any flag does.
"""

from __future__ import annotations

import argparse
import logging

from spokefs import config
from spokefs.errors import ConfigError

log = logging.getLogger(__name__)

# Passed to the kernel as they are (both engines know them).
KERNEL = frozenset({"noexec"})
IGNORED = frozenset({
    "defaults", "rw", "ro", "auto", "noauto", "user", "users", "nouser", "owner", "group",
    "_netdev", "nofail", "nosuid", "nodev", "suid", "dev", "exec", "async", "sync", "atime",
    "noatime", "relatime", "norelatime", "strictatime", "nostrictatime", "nodiratime",
    "diratime", "lazytime", "nolazytime", "silent", "loud", "default_permissions"})
IGNORED_PREFIXES = ("x-", "comment=")


def parse_mode(text: str | int) -> int:
    """Permission bits in octal: "0644", "644", "0o644" -> 0o644; nothing above 0o777."""
    if isinstance(text, int):
        value = text
    else:
        t = text.strip().lower().removeprefix("0o")
        try:
            value = int(t, 8)
        except ValueError:
            raise ConfigError(f"not a mode: {text!r} (octal permission bits, e.g. 0444, "
                              "0755)") from None
    if not 0 <= value <= 0o777:
        raise ConfigError(f"mode {text!r}: permission bits only, 0 to 0777 (no setuid, "
                          "setgid or sticky)")
    return value


def split(values: list[str]) -> list[tuple[str, str | None]]:
    """``["ro,uid=5", "deadline=1m"]`` -> ``[("ro", None), ("uid", "5"), ("deadline", "1m")]``."""
    out: list[tuple[str, str | None]] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, v = part.partition("=")
            out.append((key.strip(), v.strip() if sep else None))
    return out


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The mount's options by ``-o`` name (underscores; ``no_short_circuit``)."""
    out = {}
    for a in parser._actions:
        if (a.option_strings and a.help is not argparse.SUPPRESS and a.dest not in
                (argparse.SUPPRESS, "help", "options", "config", "print_config")):
            out[config._key(a)] = a
    return out


def apply_o(parser: argparse.ArgumentParser, args: argparse.Namespace,
            values: list[str]) -> list[str]:
    """Set what ``-o`` says on ``args`` (as flags would); returns the options for the kernel.
    ConfigError for an option the mount does not know, a bad value, or one given twice."""
    actions = _actions(parser)
    kernel: list[str] = []
    by_o: set[str] = set()
    for key, value in split(values):
        name = key.replace("-", "_")
        if name in IGNORED or key.startswith(IGNORED_PREFIXES):
            if name == "rw":
                log.info("-o rw: ignored, a snapshot mount is read-only")
            continue
        if name in KERNEL and value is None:
            kernel.append(name)
            continue
        action = actions.get(name)
        if action is None:
            raise ConfigError(f"-o {key}: not a mount option (the usual: allow_other, ro, "
                              f"uid=, gid=, file_mode=, dir_mode=, noexec; spokefs's: "
                              f"{', '.join(sorted(set(actions) - {'allow_other', 'uid', 'gid'}))})")
        where = f"-o {key}"
        if value is None:
            if action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction):
                raise ConfigError(f"{where}: needs a value ({key}=...)")
            value = "on"
        dest = action.dest
        if config.origin(args, dest).kind == "flag" and dest not in by_o:
            raise ConfigError(f"{where} and {config._long(action)} both given: use one")
        setattr(args, dest, config.convert(action, value, where, config.default_of(action)))
        by_o.add(dest)
    return kernel
