"""One configuration model for every command: each option of ``spokefs COMMAND`` can also be
set from the environment and from a TOML file, with one precedence,

    flag  >  environment  >  config file  >  default,

shown by ``spokefs COMMAND --print-config`` (each setting, its value, where it came from).

Names, for the option ``--cache-size`` of ``spokefs spoke serve``:

- environment: ``SPOKEFS_SPOKE_SERVE_CACHE_SIZE`` (the whole command path), else
  ``SPOKEFS_SPOKE_CACHE_SIZE`` (the first command word: one name for what every action of
  ``spokefs spoke`` shares). A single-word command has one name: ``SPOKEFS_MOUNT_ENGINE``.
  The options before the command have none: ``SPOKEFS_LOG_FORMAT``, ``SPOKEFS_TOKEN_FILE``.
- file (``--config FILE``, else ``SPOKEFS_CONFIG``): the key ``cache_size`` (or
  ``cache-size``) in the table ``[spoke.serve]``, else in ``[spoke]``; the options before the
  command are keys at the top of the file. A table of the command being run may hold only
  its settings: a misspelt key is an error, not a silent default.

Values: on/off options take ``1 true yes on`` or ``0 false no off`` (TOML: true or false);
``--no-X`` options are set by their own name (``SPOKEFS_SPOKE_SERVE_NO_FSYNC=1``); repeated
options take a TOML array, or in the environment a comma-separated list (or a TOML array,
``["a,b", "c"]``); sizes and durations take what their flag takes (``200GiB``, ``30s``) or
a number (bytes, seconds). A value that does not convert is an error naming where it came from.
Positional arguments (URL, DIR, MOUNTPOINT) are given on the command line only, and internal
commands and options (hidden from ``--help``) take nothing from the environment or a file.

It walks the argparse parser once, after every module registered its commands, so a flag
added anywhere is covered without a line here. (pydantic-settings would need a model per
command beside each parser; importing pydantic alone costs more than this module.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spokefs.errors import ConfigError

PREFIX = "SPOKEFS"
ENV_CONFIG = "SPOKEFS_CONFIG"
PATH_DEST = "_command_path"    # set on the namespace by the command's own parser
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})
_RANK = {"flag": 3, "env": 2, "file": 1, "default": 0}
_SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


class _Default:
    """Stands for an option's default while the command line is parsed, so an option left
    out is told from one given with its default value; ``%(default)s`` still reads well."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class Setting:
    """One option of one command, and its names outside the command line."""

    action: argparse.Action
    key: str                   # the file's key: cache_size
    envs: tuple[str, ...]      # most specific first
    sections: tuple[tuple[str, ...], ...]  # the file's tables to look in, most specific first
    default: Any
    required: bool

    @property
    def flag(self) -> str:
        return _long(self.action)


@dataclass
class Origin:
    """Where a setting's value came from: kind is flag, env, file or default."""

    kind: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.where}".strip()

    @property
    def rank(self) -> int:
        return _RANK[self.kind]


@dataclass
class Resolved:
    """A command's settings once resolved: the command's words, each setting's origin."""

    path: tuple[str, ...]
    settings: list[Setting]
    origins: dict[str, Origin] = field(default_factory=dict)   # by dest
    config_file: Path | None = None


class Model:
    """Every command's settings, made by walking a finished parser (``prepare``)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.root = parser
        self.globals: list[Setting] = []
        self.leaves: dict[tuple[str, ...], tuple[argparse.ArgumentParser, list[Setting]]] = {}
        self.children: dict[tuple[str, ...], set[str]] = {}   # visible command words

    def settings(self, path: tuple[str, ...]) -> list[Setting]:
        return self.leaves[path][1]

    def keys_under(self, path: tuple[str, ...]) -> set[str]:
        """Every file key a leaf at or below ``path`` takes."""
        return {s.key for p, (_, ss) in self.leaves.items() if p[:len(path)] == path
                for s in ss}


def default_of(action: argparse.Action) -> Any:
    """An option's own default, also while ``prepare`` holds it in a marker."""
    d = action.default
    return d.value if isinstance(d, _Default) else d


def env_name(*words: str) -> str:
    return "_".join([PREFIX, *(w.upper().replace("-", "_") for w in words)])


def _long(action: argparse.Action) -> str:
    """The option's name: its first long form (--tier-copies, not --no-tier-copies)."""
    return next((o for o in action.option_strings if o.startswith("--")),
                action.option_strings[0])


def _key(action: argparse.Action) -> str:
    return _long(action).lstrip("-").replace("-", "_")


def _eligible(action: argparse.Action) -> bool:
    return (bool(action.option_strings) and not isinstance(action, _SKIP)
            and action.help is not argparse.SUPPRESS and action.dest is not argparse.SUPPRESS
            and action.dest not in ("config", "print_config"))


def _take(action: argparse.Action, path: tuple[str, ...]) -> Setting:
    """Make ``action`` a setting: its default replaced by a marker while parsing, and not
    required of the command line (the environment or a file may give it)."""
    key = _key(action)
    if path:
        envs = tuple(dict.fromkeys((env_name(*path, key), env_name(path[0], key))))
        sections = tuple(path[:n] for n in range(len(path), 0, -1))
    else:
        envs, sections = (env_name(key),), ((),)
    s = Setting(action, key, envs, sections, action.default, action.required)
    action.required = False
    # count and append build on the default in place: None keeps "not given" visible.
    counted = isinstance(action, argparse._CountAction | argparse._AppendAction)
    action.default = None if counted else _Default(action.default)
    return s


def prepare(parser: argparse.ArgumentParser) -> Model:
    """Walk a finished parser: every visible option of every command becomes a setting;
    each command gains ``--config`` and ``--print-config``; hidden commands leave help."""
    model = Model(parser)
    model.globals = [_take(a, ()) for a in parser._actions if _eligible(a)]
    _walk(model, parser, ())
    parser._spokefs_model = model  # type: ignore[attr-defined]
    return model


def _walk(model: Model, parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        if path:
            _leaf(model, parser, path)
        return
    for sub in subs:
        hidden = {c.dest for c in sub._choices_actions if c.help is argparse.SUPPRESS}
        # argparse prints a hidden command's help as "==SUPPRESS==": leave it out instead.
        sub._choices_actions = [c for c in sub._choices_actions if c.dest not in hidden]
        if sub.metavar is None:
            sub.metavar = "{" + ",".join(c.dest for c in sub._choices_actions) + "}"
        model.children[path] = {c.dest for c in sub._choices_actions}
        seen: set[int] = set()
        for name, child in sub.choices.items():
            if name in hidden or id(child) in seen:   # aliases share a parser
                continue
            seen.add(id(child))
            _walk(model, child, (*path, name))


def _leaf(model: Model, parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
    settings: list[Setting] = []
    dests: set[str] = set()
    for a in parser._actions:
        if _eligible(a) and a.dest not in dests:   # two flags of one dest: the first names it
            dests.add(a.dest)
            settings.append(_take(a, path))
    names = " or ".join(dict.fromkeys((env_name(*path, "OPTION"), env_name(path[0], "OPTION"))))
    g = parser.add_argument_group(
        "configuration", f"each option also as {names}, or in [{'.'.join(path)}] of a "
        "--config file (flag > env > file)")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help=f"read settings from this TOML file (else {env_name(*path, 'CONFIG')}"
                   f" or {ENV_CONFIG})")
    g.add_argument("--print-config", action="store_true",
                   help="print every setting, its value and where it came from, then exit")
    parser.set_defaults(**{PATH_DEST: path})
    model.leaves[path] = (parser, settings)


# -- resolving -----------------------------------------------------------------------------
def resolve(parser: argparse.ArgumentParser, ns: argparse.Namespace,
            environ: dict[str, str] | None = None) -> Resolved:
    """Fill every setting the command line left out from the environment, then the config
    file, then its default, in place on ``ns``; ConfigError for a value that does not convert,
    naming its source. ``prepare(parser)`` must have run before ``parser.parse_args``."""
    model: Model = parser._spokefs_model  # type: ignore[attr-defined]
    env = os.environ if environ is None else environ
    path: tuple[str, ...] = getattr(ns, PATH_DEST, ())
    settings = model.globals + (model.settings(path) if path in model.leaves else [])
    out = Resolved(path, settings)
    doc, out.config_file = _load_file(model, ns, path, env)
    for s in settings:
        dest = s.action.dest
        value = getattr(ns, dest, None)
        if not isinstance(value, _Default) and value is not None:
            if isinstance(s.action, argparse._AppendAction) and s.default:
                value = [*s.default, *value]   # as argparse appends to a list default
            setattr(ns, dest, value)
            out.origins[dest] = Origin("flag")
            continue
        got = _from_env(s, env) or _from_file(s, doc, out.config_file)
        if got is None:
            setattr(ns, dest, _default(s))
            out.origins[dest] = Origin("default")
        else:
            origin, raw = got
            setattr(ns, dest, convert(s.action, raw, str(origin), s.default))
            out.origins[dest] = origin
    missing = [s for s in settings if s.required and getattr(ns, s.action.dest) is None]
    if missing:
        leaf = model.leaves[path][0] if path in model.leaves else parser
        leaf.error("the following arguments are required: " + ", ".join(
            f"{s.flag} (or {s.envs[0]}, or {s.key} in a --config file)" for s in missing))
    ns._config = out
    return out


def _default(s: Setting) -> Any:
    d = s.default
    if isinstance(d, str) and s.action.type is not None and s.action.nargs not in (0, "*", "+"):
        return convert(s.action, d, "the default", None)   # argparse converts str defaults
    if isinstance(s.action, argparse._AppendAction):
        return list(d) if d is not None else None
    return d


def _from_env(s: Setting, env: Any) -> tuple[Origin, Any] | None:
    for name in s.envs:
        if env.get(name, "") != "":  # set but empty means unset, as the code read it before
            return Origin("env", name), env[name]
    return None


def _from_file(s: Setting, doc: dict[str, Any], file: Path | None) -> tuple[Origin, Any] | None:
    for section in s.sections:
        table = _table(doc, section)
        for key in (s.key, s.key.replace("_", "-")):
            if key in table and not isinstance(table[key], dict):  # a table: a subcommand's
                where = f"{file} [{'.'.join(section)}] {key}" if section else f"{file} {key}"
                return Origin("file", where), table[key]
    return None


def _table(doc: dict[str, Any], section: tuple[str, ...]) -> dict[str, Any]:
    t: Any = doc
    for word in section:
        t = t.get(word, {}) if isinstance(t, dict) else {}
    return t if isinstance(t, dict) else {}


def _load_file(model: Model, ns: argparse.Namespace, path: tuple[str, ...],
               env: Any) -> tuple[dict[str, Any], Path | None]:
    if path not in model.leaves:  # an internal command: its own --config is not ours
        return {}, None
    file: Path | None = getattr(ns, "config", None)
    if file is None:
        for name in (*dict.fromkeys((env_name(*path, "config"), env_name(path[0], "config"))),
                     ENV_CONFIG):
            if env.get(name):
                file = Path(env[name])
                break
    if file is None:
        return {}, None
    try:
        doc = tomllib.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {file}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {file}: not valid TOML: {exc}") from exc
    _check_file(model, doc, path, file)
    return doc, file


def _check_file(model: Model, doc: dict[str, Any], path: tuple[str, ...], file: Path) -> None:
    """A key the command being run cannot take, in a table it reads, is a mistake."""
    known = {s.key for s in model.globals}
    for key, value in doc.items():
        norm = key.replace("-", "_")
        if not isinstance(value, dict) and norm not in known:
            raise ConfigError(f"config file {file}: {key!r} at the top is not an option of "
                              f"spokefs (those: {', '.join(sorted(known))}; a command's "
                              "settings go in its table, e.g. [spoke.serve])")
    for n in range(1, len(path) + 1):
        section = path[:n]
        table = _table(doc, section)
        keys = model.keys_under(section)
        kids = model.children.get(section, set())
        for key, value in table.items():
            norm = key.replace("-", "_")
            if isinstance(value, dict) and key in kids:
                continue
            if norm not in keys:
                raise ConfigError(f"config file {file} [{'.'.join(section)}]: {key!r} is not "
                                  f"an option of spokefs {' '.join(section)} (those: "
                                  f"{', '.join(sorted(keys))})")


def _bool(raw: Any, where: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ConfigError(f"{where}={raw!r}: expected on or off (1, true, yes, on / 0, false, "
                      "no, off)")


def _items(raw: Any, where: str) -> list[Any]:
    if isinstance(raw, list):
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("["):
            try:
                return list(tomllib.loads(f"v = {text}")["v"])
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{where}={raw!r}: not a list: {exc}") from exc
        return [part.strip() for part in text.split(",") if part.strip()]
    return [raw]


def _scalar(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ConfigError(f"{where}={raw!r}: expected a string or a number")
    text = raw if isinstance(raw, str) else str(raw)
    try:
        value = action.type(text) if action.type is not None else text  # type: ignore[misc]
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        why = str(exc) or f"not a valid {getattr(action.type, '__name__', 'value')}"
        if isinstance(exc, ValueError) and action.type in (int, float):
            why = f"not {'an integer' if action.type is int else 'a number'}"
        raise ConfigError(f"{where}={raw!r}: {why}") from exc
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}={raw!r}: use one of "
                          f"{', '.join(map(str, action.choices))}")
    return value


def convert(action: argparse.Action, raw: Any, where: str, default: Any) -> Any:
    """The value an option takes from ``raw`` (a string, or a TOML value), as the command
    line would give it; ConfigError naming ``where`` when it does not convert."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return _bool(raw, where)
    if isinstance(action, argparse._StoreConstAction):  # store_true, store_false
        on = _bool(raw, where)
        return action.const if on else default
    if isinstance(action, argparse._CountAction):
        if isinstance(raw, bool):
            return int(raw)
        try:
            n = int(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{where}={raw!r}: not a count (0, 1, 2...)") from None
        if n < 0:
            raise ConfigError(f"{where}={raw!r}: not a count (0, 1, 2...)")
        return n
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") \
            or isinstance(action.nargs, int):
        return [_scalar(action, item, where) for item in _items(raw, where)]
    if action.nargs == "?" and raw == "":
        return action.const
    return _scalar(action, raw, where)


# -- showing -------------------------------------------------------------------------------
def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def render(ns: argparse.Namespace, resolved: Resolved | None = None) -> str:
    """Every setting of the command in TOML (what ``--print-config`` prints), each with
    where its value came from."""
    r: Resolved = resolved or ns._config
    lines = [f"# spokefs {' '.join(r.path)}: every setting, its value and where it came "
             "from (flag > environment > config file > default)"]
    if r.config_file is not None:
        lines.append(f"# config file: {r.config_file}")
    rows_global, rows_cmd = [], []
    for s in r.settings:
        value = getattr(ns, s.action.dest, None)
        origin = r.origins.get(s.action.dest, Origin("default"))
        note = f"{origin}  [{' | '.join(s.envs)}]"
        row = (f"# {s.key} (unset)" if value is None else f"{s.key} = {_toml(value)}", note)
        (rows_global if not s.sections[0] else rows_cmd).append(row)
    width = max((len(a) for a, _ in rows_global + rows_cmd), default=0)
    lines += [f"{a:<{width}}  # {b}" for a, b in rows_global]
    if r.path:
        lines.append(f"[{'.'.join(r.path)}]")
        lines += [f"{a:<{width}}  # {b}" for a, b in rows_cmd]
    return "\n".join(lines)


def print_config(ns: argparse.Namespace) -> int:
    print(render(ns))
    sys.stdout.flush()
    return 0


def origin(ns: argparse.Namespace, dest: str) -> Origin:
    """Where ``dest``'s value came from (default when the namespace was not resolved)."""
    r: Resolved | None = getattr(ns, "_config", None)
    return r.origins.get(dest, Origin("default")) if r is not None else Origin("default")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``parse_args`` also resolves the environment and the config
    file, once ``prepare`` has walked it (its subcommands' parsers are of this class too,
    and leave that to the root)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        ns = super().parse_args(args, namespace)
        if hasattr(self, "_spokefs_model"):
            resolve(self, ns)
        return ns
