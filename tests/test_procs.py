"""The one launcher (spokefs.procs): ready lines, and never a hang on a child that fails."""

from __future__ import annotations

import sys
import time

import pytest

from spokefs.procs import Child, StartError


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_ready_line_is_seen_and_the_rest_relayed() -> None:
    heard: list[str] = []
    code = "print('starting', flush=True); print('up and ready', flush=True); print('later')"
    with Child(_python(code), lambda line: "ready" in line, on_line=heard.append) as c:
        assert c.ready_line == "up and ready"
        assert c.wait(10) == 0
    assert heard == ["starting\n", "later\n"]
    assert "".join(c.output) == "starting\nup and ready\nlater\n"


def test_silent_child_fails_within_its_deadline() -> None:
    # The launcher this replaced waited for a line before looking at the clock: a child that
    # printed nothing and did not exit held it forever.
    c = Child(_python("import time; time.sleep(60)"), lambda line: True, name="silent")
    t0 = time.monotonic()
    with pytest.raises(StartError, match=r"silent printed no ready line within 0.5s"):
        c.start(timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert not c.alive(), "a child that failed to start is killed"


def test_child_that_exits_shows_why() -> None:
    code = "import sys; sys.stderr.write('cannot bind: address in use\\n'); sys.exit(3)"
    c = Child(_python(code), lambda line: False, name="hub")
    with pytest.raises(StartError, match=r"(?s)hub exited with status 3 .*address in use"):
        c.start(timeout=30)


def test_output_after_ready_can_be_dropped() -> None:
    code = "print('ready', flush=True); print('x' * 10)"
    c = Child(_python(code), lambda line: line.startswith("ready"), keep_output=False).start(30)
    c.wait(10)
    assert c.output == ["ready\n"]
