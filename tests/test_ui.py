"""The dashboard (``/ui``) in a real browser: Debian's chromium driven by playwright.

A real hub and spoke, a small workload (a warm-up, reads, a job's step reports), then the
page: every figure it shows must equal what ``/metrics`` and ``/v1/status`` say. A
screenshot is kept (the test's tmp folder, and ``.ci-artifacts/`` when that exists). When
playwright or chromium cannot start here, the tests say why and are skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from servers import ServerProcess, spoke
from spokefs.client.control import SpokeControl

ARTIFACTS = Path(__file__).resolve().parents[1] / ".ci-artifacts"
TOKEN = "reader-" + "r" * 32
http = urllib3.PoolManager(retries=False)
ONE = ("--workers", "1")  # starts in a third of the time; replicas: tests/test_jobsignal.py


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.skip(f"playwright is not installed ({exc}); pip install -e '.[test]'")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here; scripts/install-system-deps.sh installs Debian's")
    try:
        pw = sync_playwright().start()  # playwright's driver (a node program in the wheel)
    except Exception as exc:
        pytest.skip(f"playwright could not start: {str(exc).strip().splitlines()[0]}")
    try:
        b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"], timeout=20_000)
    except Exception as exc:  # a browser that cannot start here is a skip, said so
        pw.stop()
        pytest.skip(f"chromium ({chromium}) could not start: {str(exc).strip().splitlines()[0]}")
    yield b
    b.close()
    pw.stop()


def metrics(base: str) -> dict[str, float]:
    """Each metric's samples summed over their labels."""
    out: dict[str, float] = {}
    for line in http.request("GET", f"{base}/metrics").data.decode().splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def status(base: str, token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return json.loads(http.request("GET", f"{base}/v1/status", headers=headers).data)


def settled(base: str, timeout: float = 10.0) -> dict[str, float]:
    """The metrics once the spoke stopped moving bytes (prefetch done, writes committed):
    two scrapes 0.3 s apart that agree on every figure the page shows."""
    keys = ("spokefs_upstream_bytes_total", "spokefs_served_bytes_total",
            "spokefs_cache_bytes", "spokefs_cache_hits_total", "spokefs_cache_misses_total",
            "spokefs_warm_done_blocks_total")
    end = time.monotonic() + timeout
    last = metrics(base)
    while time.monotonic() < end:
        time.sleep(0.3)
        now = metrics(base)
        if all(now.get(k) == last.get(k) for k in keys):
            return now
        last = now
    raise AssertionError(f"the spoke kept moving bytes for {timeout}s")


def value(page: Any, selector: str) -> str:
    return page.locator(selector).first.get_attribute("data-value") or ""


def js_number(x: float) -> str:
    """``String(x)`` in JavaScript: how the page writes a number into ``data-value``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def wait_value(page: Any, selector: str, expected: float) -> None:
    """Wait until the page shows exactly ``expected`` (the page does the same sums and
    divisions in doubles). Playwright's own waiting on a condition, no sleeps; through the
    locator API, as the page's Content-Security-Policy forbids evaluating strings."""
    from playwright.sync_api import expect

    expect(page.locator(selector).first).to_have_attribute(
        "data-value", js_number(expected), timeout=10_000)


def wait_polls(page: Any, n: int) -> None:
    """Until the page has read the server ``n`` times (or more) since it loaded."""
    from playwright.sync_api import expect

    more = "|".join(str(i) for i in range(n, 10)) + r"|\d\d+"
    expect(page.locator("body")).to_have_attribute("data-polls", re.compile(f"^({more})$"),
                                                   timeout=10_000)


def watch_errors(page: Any) -> list[str]:
    """Errors the page raises or logs (a script the CSP blocked, an exception)."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
    return errors


def keep_screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    if ARTIFACTS.is_dir():
        shutil.copy(shot, ARTIFACTS / name)
    return shot


def test_spoke_page_shows_what_metrics_say(browser: Any, ro_hub: ServerProcess,
                                           ro_dataset: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.toml"  # a reserved share, for the shares table
    rules.write_text("[datasets.ds]\nmin_share = 0.5\nmax_share = 0.75\n")
    with spoke(ro_hub.url, tmp_path / "cache", "64MiB", *ONE, "--dataset-config",
               str(rules)) as s:
        base = s.url
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        errors = watch_errors(page)
        page.goto(f"{base}/ui")  # redirects to /ui/
        assert page.url.endswith("/ui/")
        page.goto(f"{base}/ui/?every=0.3")
        wait_polls(page, 1)
        assert page.locator("#role").get_attribute("data-value") == "spoke"

        # The workload, while the page watches: a warm-up of one folder, reads of another
        # (misses, then hits), and a job's step reports (data-bound: 15% of its time waiting).
        ctl = SpokeControl(f"{base}/ds", job="train")
        ctl.warm(prefix="class0", wait=True, progress=False, timeout=20, poll=0.05)
        files = sorted(p.relative_to(ro_dataset).as_posix()
                       for p in (ro_dataset / "class1").iterdir())
        for _ in range(2):
            for f in files:
                assert http.request("GET", f"{base}/ds/{f}").status == 200
        ctl.report_steps([(0.1, 0.9)] * 3 + [(0.3, 0.7)])
        m = settled(base)
        st = status(base)

        hits, misses = m["spokefs_cache_hits_total"], m["spokefs_cache_misses_total"]
        assert hits > 0 and misses > 0
        wait_value(page, "#hit-ratio", hits / (hits + misses))
        assert page.inner_text("#hit-ratio") == f"{100 * hits / (hits + misses):.1f}%"
        assert st["hit_ratio"] == pytest.approx(hits / (hits + misses))
        wait_value(page, "#upstream-bytes", m["spokefs_upstream_bytes_total"])
        wait_value(page, "#served-bytes", m["spokefs_served_bytes_total"]
                   + m.get("spokefs_short_circuit_bytes_total", 0.0))
        wait_value(page, "#cache-bytes", m["spokefs_cache_bytes"])
        wait_value(page, "#cache-fill",
                   m["spokefs_cache_bytes"] / m["spokefs_cache_capacity_bytes"])

        # Warm-up progress: done over asked, per dataset, as /metrics counts them.
        asked, done = m["spokefs_warm_blocks_total"], m["spokefs_warm_done_blocks_total"]
        assert asked > 0
        row = '#warmups tr[data-dataset="ds"]'
        wait_value(page, f"{row} .progress", done / asked)
        assert page.inner_text(f"{row} .blocks") == f"{int(done):,} / {int(asked):,}"
        assert page.inner_text(f"{row} .eta") == "done"
        assert page.locator("#verdict-warm").get_attribute("data-state") == "ok"

        # The job's data-wait share, as /v1/status reports it; the verdict says data-bound.
        (job,) = st["jobs"]
        assert job["steps"] == 4 and job["data_wait_share"] == pytest.approx(0.15)
        row = '#jobs tr[data-job="ds/train"]'
        wait_value(page, f"{row} .share", job["data_wait_share"])
        assert page.inner_text(f"{row} .share") == "15.0%"
        assert value(page, f"{row} .steps") == "4"
        wait_value(page, f"{row} .util", job["utilisation"])
        assert page.locator("#verdict-data").get_attribute("data-state") == "bad"
        assert page.inner_text("#verdict-data").startswith("yes")

        # The dataset's share of the cache, as /v1/status says.
        (share,) = st["datasets"]["shares"]
        row = '#shares tr[data-dataset="ds"]'
        wait_value(page, f"{row} .resident", share["resident_bytes"])
        assert share["resident_bytes"] == m["spokefs_cache_bytes"]
        assert value(page, f"{row} .reserved") == str(32 << 20) == str(share["min_bytes"])
        assert value(page, f"{row} .ceiling") == str(48 << 20)
        assert page.inner_text(f"{row} .use") == "in use"
        assert page.inner_text(f"{row} .share") == "within its reservation"

        # The link: up, and measured as /v1/status says.
        assert value(page, "#link-state") == "up"
        link = st["link"]
        wait_value(page, "#link-rtt", link["rtt_s"])
        wait_value(page, "#link-bandwidth", link["bandwidth_bytes_per_s"])
        wait_value(page, "#link-window", link["window_bytes"])
        wait_value(page, "#link-queued", st["queued"])
        wait_value(page, "#link-inflight", st["inflight_bytes"])
        assert page.locator("#verdict-link").get_attribute("data-state") == "ok"
        from playwright.sync_api import expect

        expect(page.locator("#chart-cache")).to_have_attribute(
            "data-points", re.compile(r"^[1-9]\d*$"), timeout=10_000)
        shot = keep_screenshot(page, tmp_path, "ui-spoke.png")
        assert shot.stat().st_size > 10_000
        assert errors == []
        page.close()


def test_hub_page_shows_its_datasets(browser: Any, ro_hub: ServerProcess,
                                    tmp_path: Path) -> None:
    base = ro_hub.url
    assert http.request("GET", f"{base}/ds/class0/img0000.jpg").status == 200
    st = status(base)
    served = metrics(base)["spokefs_served_bytes_total"]
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors = watch_errors(page)
    page.goto(f"{base}/ui/?every=0.3")
    wait_polls(page, 1)
    assert value(page, "#role") == "hub"
    assert page.locator("#answer-data").is_hidden()  # the hub runs no jobs
    (ds,) = st["datasets"]
    row = f'#datasets tr[data-dataset="{ds["name"]}"]'
    wait_value(page, f"{row} .files", ds["latest"]["files"])
    wait_value(page, "#served-bytes", served)
    keep_screenshot(page, tmp_path, "ui-hub.png")
    assert errors == []
    page.close()


def test_with_auth_the_page_loads_and_asks_for_a_token(browser: Any, ro_hub: ServerProcess,
                                                       tmp_path: Path) -> None:
    tokens = tmp_path / "spoke.tokens"
    tokens.write_text(f"reader read {TOKEN}\n")
    with spoke(ro_hub.url, tmp_path / "cache", "64MiB", *ONE, "--auth", str(tokens)) as s:
        page_resp = http.request("GET", f"{s.url}/ui/")
        assert page_resp.status == 200  # the page holds no data: no token needed
        assert "default-src 'none'" in page_resp.headers["Content-Security-Policy"]
        assert http.request("GET", f"{s.url}/ui/app.js").status == 200
        assert http.request("GET", f"{s.url}/v1/status").status == 401  # its data does
        assert http.request("GET", f"{s.url}/metrics").status == 401

        page = browser.new_page()
        page.goto(f"{s.url}/ui/?every=0.3")
        page.wait_for_selector("#error:not([hidden])", timeout=10_000)
        assert "--auth" in page.inner_text("#error")
        page.fill("#token", TOKEN)
        page.click("#token-save")
        wait_polls(page, 1)
        assert value(page, "#role") == "spoke"
        assert page.locator("#error").is_hidden()
        # Kept for this tab's session only, and sent as a Bearer header.
        assert page.evaluate("sessionStorage.getItem('spokefs-token')") == TOKEN
        page.close()


def test_warm_up_progress_and_eta_while_it_fills(browser: Any, ro_hub: ServerProcess,
                                                 ro_dataset: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    files = sorted(p.relative_to(ro_dataset).as_posix()
                   for p in ro_dataset.glob("class*/*.jpg"))
    # A narrow link (2 MB over 400 KB/s: about 5 s), so the page sees the warm-up run.
    with ServerProcess("wan", "--listen", "127.0.0.1:0", "--upstream", ro_hub.hostport,
                       "--rtt", "20ms", "--bandwidth", "400KB/s") as w, \
            spoke(w.url, tmp_path / "cache", "64MiB", *ONE) as s:
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        errors = watch_errors(page)
        page.goto(f"{s.url}/ui/?every=0.25")
        wait_polls(page, 1)
        SpokeControl(f"{s.url}/ds").warm(paths=files, wait=False)
        verdict = page.locator("#verdict-warm")
        # Busy, with an ETA once blocks arrive (from the fill rate): both in one look.
        expect(page.locator('#verdict-warm[data-state="busy"]:not([data-eta=""])')
               ).to_be_attached(timeout=10_000)
        eta = float(verdict.get_attribute("data-eta") or "nan")
        assert 0 < eta < 60, eta
        assert page.inner_text("#verdict-warm").startswith("yes: ")
        keep_screenshot(page, tmp_path, "ui-spoke-warming.png")
        # What the page shows lies between two scrapes taken around one of its polls.
        before = metrics(s.url)
        polls = int(page.locator("body").get_attribute("data-polls") or 0)
        wait_polls(page, polls + 2)  # a poll that began after the first scrape
        shown = float(value(page, '#warmups tr[data-dataset="ds"] .progress'))
        after = metrics(s.url)
        asked = before["spokefs_warm_blocks_total"]
        assert asked == after["spokefs_warm_blocks_total"] == len(files)
        low = before["spokefs_warm_done_blocks_total"] / asked
        high = after["spokefs_warm_done_blocks_total"] / asked
        assert low <= shown <= high and low < 1  # seen while it ran
        # And when it is done: all of it, as /metrics says.
        expect(verdict).to_have_attribute("data-state", "ok", timeout=20_000)
        wait_value(page, '#warmups tr[data-dataset="ds"] .progress', 1.0)
        assert metrics(s.url)["spokefs_warm_done_blocks_total"] == len(files)
        assert errors == []
        page.close()


def test_checkpoints_written_through_the_spoke(browser: Any, tmp_path: Path) -> None:
    """The write-back card: an upload held at the spoke shows as not yet safe; once
    committed and published, nothing is unsafe and the commit is pinned in the cache."""
    from servers import hub
    from spokefs.client.uploads import Uploader

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shard = tmp_path / "rank0.distcp"
    shard.write_bytes(bytes(range(256)) * 1000)
    with hub(ckpt, tmp_path / "hubstate", "--writable", "ckpt") as h, \
            spoke(h.url, tmp_path / "cache", "64MiB", *ONE) as s:
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        errors = watch_errors(page)
        page.goto(f"{s.url}/ui/?every=0.3")
        wait_polls(page, 1)
        assert page.locator("#writeback").is_hidden()  # nothing written yet
        up = Uploader(s.url, "ckpt", deadline=10)
        up.put("step-1/rank0.distcp", shard)  # held here; no commit yet
        row = '#writeback tr[data-dataset="ckpt"]'
        wait_value(page, f"{row} .unsafe", shard.stat().st_size)
        up.commit(prefix="step-1/")
        assert up.wait_safe("step-1/", timeout=30)
        wait_value(page, f"{row} .unsafe", 0)
        wait_value(page, f"{row} .waiting", 0)
        wait_value(page, "#wb-pinned", shard.stat().st_size)
        wait_value(page, "#wb-sent", metrics(s.url)["spokefs_writeback_sent_bytes_total"])
        keep_screenshot(page, tmp_path, "ui-writeback.png")
        assert errors == []
        page.close()
