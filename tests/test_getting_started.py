"""docs/getting-started.md's local section works as written: its shell commands, taken from
the page, run in order with real processes (hub, spoke, mount) and reach a mounted dataset
whose files equal the source.

What the test does differently from a newcomer, and why:
- Blocks under a ``<!-- getting-started:skip REASON -->`` comment are not run: the install
  (this test runs in the venv it makes: the installed product is what is tested) and
  ``make demo`` (minutes, and its own test elsewhere).
- A line ending in ``&`` (a server) runs as a background process; the next line waits until
  its ``--port`` accepts connections, with a deadline (a person types slower than a server
  starts). ``kill %1 %2`` stops those processes.
- The page's ports (8470, 8471) become free ports, so the test never collides with anything
  on the machine, and HOME is a temporary folder, so ``~`` and the default state folders are
  the test's own.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import free_port
from spokefs.mount import sysfs
from spokefs.mount.process import fuse_unusable, unmount

PAGE = Path(__file__).parent.parent / "docs" / "getting-started.md"
BEGIN, END = "<!-- getting-started:local -->", "<!-- /getting-started:local -->"
SKIP = re.compile(r"^<!-- getting-started:skip (.+) -->$")
PAGE_PORTS = ("8470", "8471")
# What the page writes and then reads through the mount (relative to HOME).
SOURCE = Path("spokefs-try/mydata/train/hello.txt")
MOUNTED = Path("spokefs-try/mnt/train/hello.txt")
MOUNTPOINT = Path("spokefs-try/mnt")
STEP_TIMEOUT = 120.0  # a foreground command; a server's port within this too

FUSE_REASON = fuse_unusable()


@dataclass
class Block:
    commands: list[str]
    skip: str | None  # why the test does not run it


def blocks(text: str) -> list[Block]:
    """The fenced ``sh`` blocks between the page's local markers, each with its commands
    (a line ending in a backslash continues on the next)."""
    if BEGIN not in text or END not in text:
        raise AssertionError(f"{PAGE} lacks the markers {BEGIN} ... {END}")
    section = text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines()
    out: list[Block] = []
    skip: str | None = None
    i = 0
    while i < len(section):
        line = section[i].strip()
        if m := SKIP.match(line):
            skip = m.group(1)
        elif line == "```sh":
            body: list[str] = []
            i += 1
            while section[i].strip() != "```":
                body.append(section[i])
                i += 1
            commands: list[str] = []
            for raw in body:
                if commands and commands[-1].endswith("\\"):
                    commands[-1] = commands[-1][:-1] + " " + raw.strip()
                elif raw.strip() and not raw.strip().startswith("#"):
                    commands.append(raw.strip())
            out.append(Block(commands, skip))
            skip = None
        elif line.startswith("```"):  # another language's block: not commands
            skip = None
        i += 1
    return out


def test_the_page_marks_its_commands() -> None:
    """The markers the test reads are there, and the section holds each step it promises
    (without FUSE the other test skips: this one still catches a page that lost them)."""
    found = blocks(PAGE.read_text())
    run = [c for b in found if b.skip is None for c in b.commands]
    skipped = [c for b in found if b.skip is not None for c in b.commands]
    assert any(c.startswith("pip install") for c in skipped)
    for step in ("spokefs hub snapshot", "spokefs hub serve", "spokefs spoke serve",
                 "spokefs mount", "ls ", "cat ", "spokefs umount"):
        assert any(c.startswith(step) for c in run), f"the page runs no {step!r}"
    assert sum(c.endswith("&") for c in run) == 2, "two servers in the background"


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    """Until ``port`` on 127.0.0.1 accepts a connection; fails when ``proc`` exits first or
    the deadline passes, with the process's output."""
    end = time.monotonic() + deadline
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > end:
                pytest.fail(f"nothing listens on {port} after {deadline:g}s:\n"
                            f"{log.read_text()}")
            time.sleep(0.05)  # another process's socket: nothing to block on


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    mp = tmp_path / MOUNTPOINT
    if sysfs.is_mounted(mp):  # a failed run must not leave a mount behind
        unmount(mp)


@pytest.mark.skipif(FUSE_REASON is not None, reason=f"no FUSE: {FUSE_REASON}")
def test_the_local_section_reaches_a_mounted_dataset(home: Path) -> None:
    ports = {p: str(free_port()) for p in PAGE_PORTS}
    env = {**os.environ, "HOME": str(home),
           # the venv this test runs in, as `. .venv/bin/activate` puts it first
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("SPOKEFS_TOKEN", None)
    background: list[subprocess.Popen[bytes]] = []
    outputs: dict[str, bytes] = {}
    try:
        for block in blocks(PAGE.read_text()):
            if block.skip is not None:
                continue
            for command in block.commands:
                for page_port, port in ports.items():
                    command = command.replace(page_port, port)
                if re.fullmatch(r"kill( %\d+)+", command):  # the page's background jobs
                    for n in (int(j) for j in re.findall(r"%(\d+)", command)):
                        background[n - 1].terminate()
                    for p in background:
                        p.wait(timeout=30)
                    continue
                if command.endswith("&"):
                    port_m = re.search(r"--port (\d+)", command)
                    assert port_m, f"a background line names no --port: {command}"
                    log = home / f"bg{len(background)}.log"
                    with log.open("wb") as f:
                        proc = subprocess.Popen(["bash", "-c", "exec " + command[:-1].strip()],
                                                env=env, cwd=home, stdout=f,
                                                stderr=subprocess.STDOUT)
                    background.append(proc)
                    wait_port(int(port_m.group(1)), proc, log, STEP_TIMEOUT)
                    continue
                r = subprocess.run(["bash", "-c", command], env=env, cwd=home,
                                   capture_output=True, timeout=STEP_TIMEOUT)
                assert r.returncode == 0, (f"{command!r} exited with {r.returncode}:\n"
                                           f"{r.stdout.decode()}{r.stderr.decode()}")
                outputs[command] = r.stdout
        cat = f"cat ~/{MOUNTED}"
        assert cat in outputs, f"the page no longer runs {cat!r}"
        assert outputs[cat] == (home / SOURCE).read_bytes()
        assert b"same bytes" in next(v for k, v in outputs.items() if k.startswith("cmp "))
        assert not sysfs.is_mounted(home / MOUNTPOINT), "umount left it mounted"
        assert all(p.returncode is not None for p in background), "kill left a server"
    finally:
        for p in background:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_skipped_blocks_say_why() -> None:
    for b in blocks(PAGE.read_text()):
        if b.skip is not None:
            assert len(b.skip.split()) >= 3, b.skip
        for c in b.commands:
            shlex.split(c)  # every command is well-formed shell words (quotes closed)
