"""The command line: every subcommand has help that reads; bad options fail clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spokefs.cli import build_parser


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spokefs.cli", *args], capture_output=True,
                          text=True, timeout=60)


def _commands() -> list[list[str]]:
    parser = build_parser()
    out = []
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in action.choices.items():
            out.append([name])
            for a in sub._actions:
                if a.__class__.__name__ == "_SubParsersAction":
                    out.extend([name, n] for n in a.choices)
    return out


@pytest.mark.parametrize("cmd", _commands(), ids=" ".join)
def test_every_command_has_help(cmd: list[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([*cmd, "--help"])
    assert exc.value.code == 0


def test_core_commands_exist() -> None:
    names = {" ".join(c) for c in _commands()}
    assert {"hub serve", "hub snapshot", "spoke serve", "warm", "status", "demo",
            "bench serve"} <= names


def test_bad_size_is_a_clear_error(tmp_path: Path) -> None:
    r = run("spoke", "serve", "--upstream", "http://127.0.0.1:1", "--cache-dir",
            str(tmp_path), "--cache-size", "lots")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--cache-size: not a size: 'lots'" in r.stderr


def test_hub_snapshot_of_missing_dir(tmp_path: Path) -> None:
    r = run("hub", "snapshot", str(tmp_path / "nope"), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2
    assert "does not exist" in r.stderr


def test_hub_snapshot_prints_json(dataset: Path, tmp_path: Path) -> None:
    r = run("hub", "snapshot", str(dataset), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    assert '"new": true' in r.stdout
    r = run("hub", "snapshot", str(dataset), "--state-dir", str(tmp_path / "s"))
    assert '"new": false' in r.stdout and '"files_hashed": 0' in r.stdout
