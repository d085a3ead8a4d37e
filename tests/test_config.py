"""One configuration model for every command (spokefs.config): each option from a flag, the
environment (SPOKEFS_<COMMAND>_<OPTION>) or a TOML --config file, flag > env > file >
default, shown by --print-config; log levels; --version; no internal command or flag in help."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spokefs.cli import build_parser
from spokefs.config import Model
from spokefs.errors import ConfigError
from spokefs.logs import level_for


@pytest.fixture(autouse=True)
def _no_spokefs_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: a SPOKEFS_* variable of the runner's must not leak in."""
    for name in list(os.environ):
        if name.startswith("SPOKEFS_") and name not in ("SPOKEFS_FUZZ_EXAMPLES",):
            monkeypatch.delenv(name)


def run(*args: str, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOKEFS_")}
    return subprocess.run([sys.executable, "-m", "spokefs.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})}, cwd=cwd)


SPOKE = ["spoke", "serve", "--upstream", "http://127.0.0.1:1", "--cache-dir", "/c"]
MOUNT = ["mount", "http://127.0.0.1:1/ds", "/mnt"]
HUB = ["hub", "serve", "/data"]

# (command line, option, its env name, its file table, a value as text, what it becomes,
#  a second value as text, what that becomes): a sample of each kind across commands.
CASES: list[tuple[list[str], str, str, str, Any, Any, Any, Any]] = [
    # string
    (HUB, "--host", "SPOKEFS_HUB_SERVE_HOST", "hub.serve", "0.0.0.0", "0.0.0.0",
     "10.0.0.1", "10.0.0.1"),
    (["wan", "--upstream", "127.0.0.1:1"], "--listen", "SPOKEFS_WAN_LISTEN", "wan",
     "127.0.0.1:9000", ("127.0.0.1", 9000), "127.0.0.1:9001", ("127.0.0.1", 9001)),
    # int
    ([*SPOKE, "--cache-size", "1GiB"], "--max-inflight", "SPOKEFS_SPOKE_SERVE_MAX_INFLIGHT",
     "spoke.serve", "7", 7, 9, 9),
    (MOUNT, "--read-ahead-kb", "SPOKEFS_MOUNT_READ_AHEAD_KB", "mount", "1024", 1024, 512, 512),
    # size
    (SPOKE, "--cache-size", "SPOKEFS_SPOKE_CACHE_SIZE", "spoke", "2GiB", 2 << 30, "3MiB",
     3 << 20),
    (["wan", "--upstream", "127.0.0.1:1"], "--window", "SPOKEFS_WAN_WINDOW", "wan", "4MiB",
     4 << 20, 65536, 65536),
    # duration
    (MOUNT, "--deadline", "SPOKEFS_MOUNT_DEADLINE", "mount", "90s", 90.0, "2m", 120.0),
    # on/off
    ([*SPOKE, "--cache-size", "1GiB"], "--no-fsync", "SPOKEFS_SPOKE_SERVE_NO_FSYNC",
     "spoke.serve", "yes", True, True, True),
    (MOUNT, "--allow-other", "SPOKEFS_MOUNT_ALLOW_OTHER", "mount", "on", True, True, True),
    (["status", "http://127.0.0.1:1"], "--json", "SPOKEFS_STATUS_JSON", "status", "1", True,
     True, True),
    # append
    (HUB, "--dataset", "SPOKEFS_HUB_DATASET", "hub", "a=/x,b=/y", ["a=/x", "b=/y"],
     ["c=/z"], ["c=/z"]),
    # choice
    ([*SPOKE, "--cache-size", "1GiB"], "--write-io", "SPOKEFS_SPOKE_WRITE_IO", "spoke",
     "direct", "direct", "buffered", "buffered"),
    (MOUNT, "--engine", "SPOKEFS_MOUNT_ENGINE", "mount", "python", "python", "native",
     "native"),
    # path
    (MOUNT, "--spoke-cache", "SPOKEFS_MOUNT_SPOKE_CACHE", "mount", "/var/c", Path("/var/c"),
     "/srv/c", Path("/srv/c")),
    # options before the command
    ([*MOUNT], "--log-format", "SPOKEFS_LOG_FORMAT", "", "json", "json", "plain", "plain"),
]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value) + '"'


def _file(path: Path, table: str, key: str, value: Any) -> Path:
    head = f"[{table}]\n" if table else ""
    path.write_text(f"{head}{key} = {_toml(value)}\n")
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _with_flag(argv: list[str], flag: str, text: Any) -> list[str]:
    """``argv`` with ``flag`` given: before the command for the global options."""
    p = build_parser()
    globals_ = {o for a in p._actions for o in a.option_strings}
    given = [flag] if isinstance(text, bool) else [flag, str(text)]
    if isinstance(text, list):
        given = [x for v in text for x in (flag, v)]
    return [*given, *argv] if flag in globals_ else [*argv, *given]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]} {c[1]}")
def test_every_kind_of_option_can_be_set_three_ways(
        case: tuple[list[str], str, str, str, Any, Any, Any, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    argv, flag, env, table, text, value, text2, value2 = case
    dest = build_dest(argv, flag)
    # the environment
    monkeypatch.setenv(env, text)
    ns = _parse(argv)
    assert getattr(ns, dest) == value and str(ns._config.origins[dest]) == f"env {env}"
    monkeypatch.delenv(env)
    # the file (a TOML value of its own type)
    key = flag.lstrip("-").replace("-", "_")
    conf = _file(tmp_path / "c.toml", table, key, text2)
    ns = _parse([*argv, "--config", str(conf)])
    assert getattr(ns, dest) == value2 and ns._config.origins[dest].kind == "file"
    # the flag, over both
    monkeypatch.setenv(env, text)
    if isinstance(value, bool):  # the flag can only say "on": the env and file say off
        monkeypatch.setenv(env, "off")
        conf = _file(tmp_path / "c.toml", table, key, False)
        assert getattr(_parse([*argv, "--config", str(conf)]), dest) is False
        ns = _parse([*_with_flag(argv, flag, True), "--config", str(conf)])
    else:
        ns = _parse([*_with_flag(argv, flag, text2 if isinstance(text2, list) else
                                 str(text2)), "--config", str(conf)])
    assert getattr(ns, dest) == (True if isinstance(value, bool) else value2)
    assert ns._config.origins[dest].kind == "flag"


def build_dest(argv: list[str], flag: str) -> str:
    """The option's dest; its default differs from what the test sets."""
    p = build_parser()
    model: Model = p._spokefs_model  # type: ignore[attr-defined]
    words = tuple(a for a in argv if not a.startswith(("-", "/", "http", "127.")))
    path = max((q for q in model.leaves if words[:len(q)] == q), key=len)
    for s in model.globals + model.settings(path):
        if flag in s.action.option_strings:
            return s.action.dest
    raise AssertionError(f"{flag} is not a setting of {argv}")


def test_precedence_flag_env_file_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    conf = tmp_path / "spokefs.toml"
    conf.write_text('[spoke]\nport = 1001\nmax_inflight = 3\npolicy = "lru"\n'
                    '[spoke.serve]\nport = 1002\n')
    monkeypatch.setenv("SPOKEFS_SPOKE_MAX_INFLIGHT", "4")
    monkeypatch.setenv("SPOKEFS_SPOKE_SERVE_MAX_INFLIGHT", "5")   # the whole path wins
    ns = _parse([*SPOKE, "--cache-size", "1GiB", "--config", str(conf), "--policy", "s3fifo"])
    o = ns._config.origins
    assert (ns.port, str(o["port"])) == (1002, f"file {conf} [spoke.serve] port")
    assert (ns.max_inflight, str(o["max_inflight"])) == (5, "env SPOKEFS_SPOKE_SERVE_MAX_INFLIGHT")
    assert (ns.policy, o["policy"].kind) == ("s3fifo", "flag")
    assert (ns.latest_ttl, o["latest_ttl"].kind) == (10.0, "default")
    # SPOKEFS_CONFIG names the file when --config does not.
    monkeypatch.setenv("SPOKEFS_CONFIG", str(conf))
    assert _parse([*SPOKE, "--cache-size", "1GiB"]).port == 1002


def test_required_options_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("SPOKEFS_SPOKE_SERVE_UPSTREAM", "http://hub:8470")
    monkeypatch.setenv("SPOKEFS_SPOKE_CACHE_DIR", "/c")
    monkeypatch.setenv("SPOKEFS_SPOKE_CACHE_SIZE", "5GiB")
    ns = _parse(["spoke", "serve"])
    assert (ns.upstream, ns.cache_dir, ns.cache_size) == (["http://hub:8470"], Path("/c"),
                                                          5 << 30)
    r = run("spoke", "serve", "--upstream", "http://h:1")
    assert r.returncode == 2
    assert "--cache-dir (or SPOKEFS_SPOKE_SERVE_CACHE_DIR" in r.stderr


@pytest.mark.parametrize("env,value,message", [
    ("SPOKEFS_SPOKE_SERVE_CACHE_SIZE", "lots",
     "SPOKEFS_SPOKE_SERVE_CACHE_SIZE='lots': not a size"),
    ("SPOKEFS_SPOKE_SERVE_PORT", "eighty", "SPOKEFS_SPOKE_SERVE_PORT='eighty': not an integer"),
    ("SPOKEFS_SPOKE_WRITE_IO", "sideways", "SPOKEFS_SPOKE_WRITE_IO='sideways': use one of"),
    ("SPOKEFS_SPOKE_SERVE_NO_FSYNC", "maybe", "SPOKEFS_SPOKE_SERVE_NO_FSYNC='maybe': expected "
     "on or off"),
    ("SPOKEFS_LOG_FORMAT", "xml", "SPOKEFS_LOG_FORMAT='xml': use one of plain, json"),
])
def test_a_bad_value_from_the_environment_names_it(env: str, value: str, message: str) -> None:
    given = [] if "CACHE_SIZE" in env else ["--cache-size", "1GiB"]
    r = run(*SPOKE, *given, "--print-config", env={env: value})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"spokefs: error: env {message}" in r.stderr


def test_a_bad_file_names_itself(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('[spoke.serve]\ncache_size = "lots"\n')
    r = run(*SPOKE, "--config", str(conf))
    assert r.returncode == 2
    assert f"file {conf} [spoke.serve] cache_size='lots': not a size" in r.stderr
    conf.write_text('[spoke.serve]\ncache_sise = "1GiB"\n')   # a typo is not ignored
    r = run(*SPOKE, "--config", str(conf))
    assert r.returncode == 2 and "'cache_sise' is not an option of spokefs spoke serve" in r.stderr
    conf.write_text("port = 1\n")   # a command's option at the top
    r = run(*SPOKE, "--config", str(conf))
    assert r.returncode == 2 and "'port' at the top is not an option of spokefs" in r.stderr
    conf.write_text("[spoke.serve\n")
    r = run(*SPOKE, "--config", str(conf))
    assert r.returncode == 2 and "not valid TOML" in r.stderr
    r = run(*SPOKE, "--config", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "nope.toml" in r.stderr
    # Tables of other commands are theirs to check: one file serves several commands.
    conf.write_text('[hub.serve]\nport = 8470\n[spoke.serve]\ncache_size = "1GiB"\n')
    r = run(*SPOKE, "--config", str(conf), "--print-config")
    assert r.returncode == 0, r.stderr


def test_print_config_shows_each_value_and_where_it_came_from(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('log_format = "json"\n[spoke]\ncache_size = "2GiB"\n'
                    '[spoke.serve]\ntier-copies = false\n')
    r = run(*SPOKE, "--config", str(conf), "--max-inflight", "3", "--print-config",
            env={"SPOKEFS_SPOKE_SERVE_PORT": "9999"})
    assert r.returncode == 0, r.stderr
    lines = {line.lstrip("# ").split(" ")[0]: line for line in r.stdout.splitlines()
             if line.strip()}
    assert "# file " in lines["log_format"] and '"json"' in lines["log_format"]
    assert "2147483648" in lines["cache_size"] and f"file {conf} [spoke] cache_size" in \
        lines["cache_size"]
    assert "9999" in lines["port"] and "env SPOKEFS_SPOKE_SERVE_PORT" in lines["port"]
    assert "= 3" in lines["max_inflight"] and "# flag" in lines["max_inflight"]
    assert "= false" in lines["tier_copies"] and "# file" in lines["tier_copies"]
    assert "# default" in lines["policy"] and '"belady"' in lines["policy"]
    assert "(unset)" in lines["tier"]
    # What it prints is a config file that gives the same settings back.
    again = tmp_path / "again.toml"
    again.write_text(r.stdout)
    r2 = run(*SPOKE, "--config", str(again), "--print-config")
    assert r2.returncode == 0, r2.stderr
    values = {k: v.split("#")[0].strip() for k, v in lines.items() if not v.startswith("#")}
    for line in r2.stdout.splitlines():
        key = line.split("=")[0].strip()
        if key in values and "=" in line and not line.startswith("#"):
            assert line.split("#")[0].strip() == values[key], key


def test_names_never_collide() -> None:
    """No environment name or file key means two different things."""
    p = build_parser()
    model: Model = p._spokefs_model  # type: ignore[attr-defined]
    owners: dict[str, set[tuple[str, ...]]] = {}
    for s in model.globals:
        owners.setdefault(s.envs[0], set()).add(())
    for path, (_, settings) in model.leaves.items():
        keys = [s.key for s in settings]
        assert len(keys) == len(set(keys)), path
        for s in settings:
            for i, name in enumerate(s.envs):   # the full path's, then the command's
                owners.setdefault(name, set()).add(path if i == 0 else (path[0], "*"))
    full = {name for name, paths in owners.items() if len(paths) > 1}
    assert not full, full
    # The variables spokefs read before this model keep their meaning.
    names = set(owners)
    assert {"SPOKEFS_LOG_FORMAT", "SPOKEFS_TOKEN_FILE", "SPOKEFS_CA_BUNDLE",
            "SPOKEFS_MOUNT_ENGINE"} <= names
    for other in ("SPOKEFS_TOKEN", "SPOKEFS_IDLE_TIMEOUT", "SPOKEFS_MAX_CONNECTIONS",
                  "SPOKEFS_JOB_RATE", "SPOKEFS_JOB_BURST", "SPOKEFS_AUDIT_INTERVAL"):
        assert other not in names, other


def test_existing_environment_variables_keep_working(tmp_path: Path) -> None:
    r = run(*MOUNT, "--print-config", env={"SPOKEFS_MOUNT_ENGINE": "python",
                                           "SPOKEFS_LOG_FORMAT": "json"})
    assert r.returncode == 0, r.stderr
    assert 'engine = "python"' in r.stdout and 'log_format = "json"' in r.stdout
    # A token file named in the environment is still read where it is used, and a token in
    # SPOKEFS_TOKEN still beats it: a missing file named there stops nothing here.
    r = run(*MOUNT, "--print-config", env={"SPOKEFS_TOKEN_FILE": str(tmp_path / "none")})
    assert r.returncode == 0, r.stderr


def test_every_command_takes_config_and_print_config() -> None:
    p = build_parser()
    model: Model = p._spokefs_model  # type: ignore[attr-defined]
    assert {("hub", "serve"), ("spoke", "serve"), ("mount",), ("wan",), ("warm",),
            ("status",)} <= set(model.leaves)
    for path, (leaf, _) in model.leaves.items():
        opts = {o for a in leaf._actions for o in a.option_strings}
        assert {"--config", "--print-config"} <= opts, path


def test_help_shows_no_internal_command_or_flag() -> None:
    for cmd in (["spoke"], ["spoke", "serve"], ["hub", "serve"], ["mount"], []):
        r = run(*cmd, "--help")
        assert r.returncode == 0
        assert "SUPPRESS" not in r.stdout and "_worker" not in r.stdout, cmd
        assert "--ready-fd" not in r.stdout and "--listen-fd" not in r.stdout
    # still there for spokefs itself
    assert run("spoke", "_worker", "--help").returncode == 0


def test_version_comes_from_the_package() -> None:
    from importlib.metadata import version

    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"spokefs {version('spokefs')}"


def test_log_levels() -> None:
    assert level_for(0, 0) == logging.INFO
    assert level_for(1, 0) == logging.DEBUG
    assert level_for(3, 0) == logging.DEBUG
    assert level_for(0, 1) == logging.WARNING
    assert level_for(0, 2) == logging.ERROR
    assert level_for(0, 0, "error") == logging.ERROR
    assert level_for(1, 0, "error", counts_rank=3, name_rank=2) == logging.DEBUG  # -v beats env
    assert level_for(1, 0, "error", counts_rank=3, name_rank=3) == logging.ERROR


def test_v_and_q_change_what_is_logged(tmp_path: Path) -> None:
    """``spokefs umount`` of a folder that is no mount logs nothing but says so; a mount of an
    unreachable spoke logs at info (the engine) and at debug (asyncio's own)."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    url = "http://127.0.0.1:1/ds"
    base = ["mount", url, str(mp), "-f", "--deadline", "1s", "--engine", "python"]
    plain = run(*base)
    assert plain.returncode != 0 and " INFO " in plain.stderr and " DEBUG " not in plain.stderr
    quiet = run("-q", *base)
    assert " INFO " not in quiet.stderr and "error" in quiet.stderr
    verbose = run("-v", *base)
    assert " DEBUG " in verbose.stderr
    assert " INFO " not in run(*base, env={"SPOKEFS_LOG_LEVEL": "warning"}).stderr
    assert " DEBUG " in run("--log-level", "debug", *base,
                            env={"SPOKEFS_LOG_LEVEL": "warning"}).stderr
    r = run("--log-level", "loud", *base)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_convert_errors_are_config_errors() -> None:
    from spokefs.config import convert

    a = argparse.ArgumentParser().add_argument("--n", type=int)
    with pytest.raises(ConfigError, match="here='x': not an integer"):
        convert(a, "x", "here", None)
    with pytest.raises(ConfigError, match="expected a string or a number"):
        convert(a, True, "here", None)
