"""``spokefs top``: the frame built from a status document and a scrape, and the command run
against a real spoke (``--once``, ``--json``, and the live view in a terminal, quit with q)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import spokefs
from servers import ServerProcess
from spokefs.client.control import SpokeControl
from spokefs.client.sync import Client
from spokefs.client.top import Sample, frame, parse_metrics, quantile, render, total
from spokefs.units import format_size

METRICS = """\
# TYPE spokefs_cache_evictions counter
spokefs_cache_evictions_total 100.0
# TYPE spokefs_upstream_bytes counter
spokefs_upstream_bytes_total{reason="demand"} 1000.0
spokefs_upstream_bytes_total{reason="prefetch"} 4000.0
# TYPE spokefs_prefetch_used_bytes counter
spokefs_prefetch_used_bytes_total 3000.0
# TYPE spokefs_integrity_failures counter
spokefs_integrity_failures_total{where="cache"} 2.0
# TYPE spokefs_requests counter
spokefs_requests_total{route="object",status="200"} 50.0
spokefs_requests_total{route="object",status="503"} 3.0
# TYPE spokefs_warm_blocks counter
spokefs_warm_blocks_total{dataset="imagenet"} 40.0
# TYPE spokefs_warm_done_blocks counter
spokefs_warm_done_blocks_total{dataset="imagenet"} 10.0
# TYPE spokefs_fetch_seconds histogram
spokefs_fetch_seconds_bucket{le="0.05"} 0.0
spokefs_fetch_seconds_bucket{le="0.1"} 10.0
spokefs_fetch_seconds_bucket{le="+Inf"} 10.0
spokefs_fetch_seconds_count 10.0
spokefs_fetch_seconds_sum 0.8
"""

STATUS = {
    "role": "spoke", "upstream": "http://hub:8470", "upstream_error": None, "uptime_s": 3725,
    "cache": {"used_bytes": 3 << 20, "data_bytes": 3 << 20, "capacity_bytes": 4 << 20,
              "blocks": 12, "policy": "belady", "writable": True, "warm_pinned_bytes": 0},
    "datasets": {"resident_bytes": {"imagenet": 3 << 20}, "hits_misses": {"imagenet": [90, 10]}},
    "hits": 90.0, "misses": 10.0, "hit_ratio": 0.9, "inflight": 2, "queued": 7,
    "inflight_bytes": 1 << 20,
    "link": {"rtt_s": 0.0602, "bandwidth_bytes_per_s": 100 << 20, "window_bytes": 12 << 20,
             "startup": False, "probing": False},
    "prefetch": {"inflight_bytes": 0, "pinned_bytes": 1 << 20, "working_sets": [
        {"dataset": "imagenet", "job": "resnet", "working_set_bytes": 8 << 20,
         "kept_bytes": 2 << 20, "resident_bytes": 1 << 20,
         "order": {"epoch": 0, "read": 30, "positions": 120}}]},
}


def sample(status: dict, metrics: str, t: float) -> Sample:
    return Sample("http://spoke:8471", status, parse_metrics(metrics), t)


def test_frame_totals_from_status_and_metrics() -> None:
    doc = frame(sample(STATUS, METRICS, 1000.0))
    assert doc["cache"]["fill"] == pytest.approx(0.75)
    assert doc["reads"]["hit_ratio"] == 0.9 and doc["reads"]["hit_ratio_recent"] is None
    assert doc["link"]["state"] == "up" and doc["link"]["rtt_s"] == 0.0602
    assert doc["link"]["queued"] == 7
    assert doc["prefetch"]["accuracy"] == pytest.approx(0.75)  # 3000 of 4000 read
    assert doc["errors"]["integrity_cache"] == 2 and doc["errors"]["http_5xx"] == 3
    assert doc["datasets"] == [{"dataset": "imagenet", "resident_bytes": 3 << 20,
                                "share_of_cache": 0.75, "hit_ratio": 0.9,
                                "warm": {"blocks": 40, "done": 10, "fraction": 0.25}}]
    (job,) = doc["working_sets"]
    assert job["resident_share"] == 0.5 and job["order_read"] == 30
    assert "training" not in doc  # no job reports steps: no section
    text = render(doc)
    assert "hit ratio 90.0%" in text and "rtt 60.2 ms" in text
    assert "accuracy 75.0%" in text and "25.0% (10/40 blocks)" in text
    assert "imagenet/resnet" in text and "30/120" in text
    assert "training job" not in text


def test_reserved_shares_get_a_table_where_the_rules_set_them() -> None:
    rows = [{"dataset": "imagenet", "resident_bytes": 3 << 20, "min_share": 0.5,
             "max_share": None, "min_bytes": 2 << 20, "max_bytes": None, "in_use": True,
             "share": "over"},
            {"dataset": "scratch", "resident_bytes": 0, "min_share": None, "max_share": None,
             "min_bytes": 0, "max_bytes": None, "in_use": None, "share": "under"}]
    st = {**STATUS, "datasets": {**STATUS["datasets"], "shares": rows}}
    doc = frame(sample(st, METRICS, 1000.0))
    assert doc["shares"] == [{"dataset": "imagenet", "resident_bytes": 3 << 20,
                              "min_bytes": 2 << 20, "max_bytes": None, "in_use": True,
                              "share": "over"}]  # no rule for scratch: not shown
    text = render(doc)
    assert "reserved" in text and "in use" in text and "over its reservation" in text
    assert "shares" not in frame(sample(STATUS, METRICS, 1000.0))


def test_frame_rates_and_recent_ratio_over_the_last_refresh() -> None:
    before = sample(STATUS, METRICS, 1000.0)
    later = {**STATUS, "hits": 190.0, "misses": 10.0, "upstream_error": "connection refused"}
    more = METRICS.replace("spokefs_cache_evictions_total 100.0",
                           "spokefs_cache_evictions_total 150.0")
    doc = frame(sample(later, more, 1002.0), before)
    assert doc["reads"]["hit_ratio_recent"] == 1.0  # 100 hits, no miss since
    assert doc["evictions"]["per_s"] == pytest.approx(25.0)
    assert doc["link"]["state"] == "down"
    text = render(doc)
    assert "DOWN" in text and "connection refused" in text and "(25.0/s)" in text
    assert "(last 2 s: 100.0%)" in text


def test_training_section_only_when_jobs_report() -> None:
    st = {**STATUS, "jobs": [{"dataset": "imagenet", "job": "resnet", "steps": 1200,
                              "data_wait_share": 0.125, "utilisation": 0.875}]}
    doc = frame(sample(st, METRICS, 1.0))
    assert doc["training"][0]["data_wait_share"] == 0.125
    text = render(doc)
    assert "training job" in text and "12.5%" in text and "87.5%" in text


def test_tier_section_only_for_a_member() -> None:
    assert "tier" not in frame(sample(STATUS, METRICS, 1.0))
    me, other = "http://10.0.0.1:8471", "http://10.0.0.2:8471"
    st = {**STATUS, "tier": {"self": me, "source": "kubernetes", "refresh_error": None,
                             "copies": True, "copy_bytes": 5 << 20, "members": [
                                 {"url": me, "state": "up", "share": 0.5, "self": True},
                                 {"url": other, "state": "down", "share": 0.5}]}}
    tier_metrics = METRICS + f"""\
# TYPE spokefs_tier_peer_bytes counter
spokefs_tier_peer_bytes_total{{peer="{other}"}} 2097152.0
# TYPE spokefs_tier_peer_requests counter
spokefs_tier_peer_requests_total{{peer="{other}",outcome="answered"}} 9.0
spokefs_tier_peer_requests_total{{peer="{other}",outcome="timed_out"}} 2.0
spokefs_tier_peer_requests_total{{peer="{other}",outcome="failed"}} 1.0
# TYPE spokefs_tier_served_bytes counter
spokefs_tier_served_bytes_total 1048576.0
"""
    doc = frame(sample(st, tier_metrics, 1.0))
    t = doc["tier"]
    assert t["copy_bytes"] == 5 << 20 and t["served_bytes"] == 1 << 20
    assert t["members"][1] == {"url": other, "state": "down", "share": 0.5, "self": False,
                               "received_bytes": 2 << 20, "failed_requests": 3.0}
    text = render(doc)
    assert "2 members (kubernetes)  copies 5.0 MiB" in text, text
    assert "(this member)" in text and "down" in text and "2.0 MiB" in text


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.05, 0.0), (0.1, 10.0), (float("inf"), 10.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.075)
    assert quantile(buckets, 1.0) == pytest.approx(0.1)
    assert quantile([(float("inf"), 0.0)], 0.5) is None
    assert total(parse_metrics(METRICS), "spokefs_upstream_bytes_total") == 5000


# -- against a real spoke -----------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spokefs.cli", *args], capture_output=True,
                          text=True, timeout=60)


def warm_everything(base: str) -> None:
    SpokeControl(f"{base}/ds").warm(wait=True, progress=False)
    # Residency says every byte is in; the warm-up's own count of ended fetches follows
    # within a turn of the spoke's loop.
    end = time.monotonic() + 30
    while time.monotonic() < end:
        m = parse_metrics(Client(base).request("GET", "/metrics").data.decode())
        asked = total(m, "spokefs_warm_blocks_total", dataset="ds")
        if asked and total(m, "spokefs_warm_done_blocks_total", dataset="ds") == asked:
            return
        time.sleep(0.05)
    raise AssertionError("the warm-up's progress never reached its end")


def test_top_once_and_json_show_what_the_spoke_reports(spoke_server: ServerProcess) -> None:
    base = spoke_server.url
    warm_everything(base)
    for i in range(3):  # hits
        with spokefs.open(f"{base}/ds/class{i % 4}/img{i:04d}.jpg") as f:
            f.read()
    r = cli("top", base, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    st = Client(base).get_json("/v1/status")  # the spoke is idle: nothing moved since
    assert doc["reads"]["hits"] == st["hits"] and doc["reads"]["misses"] == st["misses"]
    assert doc["reads"]["hit_ratio"] == st["hit_ratio"]
    assert doc["cache"]["capacity_bytes"] == st["cache"]["capacity_bytes"]
    assert doc["cache"]["used_bytes"] == st["cache"]["data_bytes"]
    (ds,) = doc["datasets"]
    assert ds["resident_bytes"] == st["datasets"]["resident_bytes"]["ds"]
    h, m = st["datasets"]["hits_misses"]["ds"]  # one dataset: its counts are the totals
    assert (h, m) == (st["hits"], st["misses"]) and h >= 3
    assert ds["hit_ratio"] == pytest.approx(h / (h + m))
    assert ds["warm"]["fraction"] == 1.0
    assert doc["link"]["upstream"] == st["upstream"] and doc["link"]["state"] == "up"
    assert doc["link"]["rtt_s"] == pytest.approx(st["link"]["rtt_s"])

    r = cli("top", base, "--once")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"spokefs top  {base}")
    assert f"hit ratio {100 * st['hit_ratio']:.1f}%" in r.stdout
    assert format_size(st["datasets"]["resident_bytes"]["ds"]) in r.stdout
    assert "100.0% (" in r.stdout and " done" in r.stdout  # the warm-up
    assert f"misses {st['misses']:,.0f}" in r.stdout


def test_live_view_in_a_terminal_quits_on_q(spoke_server: ServerProcess) -> None:
    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    proc = subprocess.Popen([sys.executable, "-m", "spokefs.cli", "top", spoke_server.url,
                             "--interval", "0.3"], stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, env={**os.environ, "COLUMNS": "120",
                                                         "LINES": "40"})
    seen = b""
    try:
        end = time.monotonic() + 60
        while b"hit ratio" not in seen and time.monotonic() < end:
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 65536)
        assert b"hit ratio" in seen, seen[-2000:]
        assert b"\x1b[?1049h" in seen  # drawn on the alternate screen
        assert termios.tcgetattr(slave)[3] & termios.ICANON == 0  # keys without Enter
        os.write(master, b"q")
        assert proc.wait(timeout=20) == 0
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end closed
                break
            if not chunk:
                break
            seen += chunk
        assert b"\x1b[?1049l" in seen  # and the terminal given back
        assert termios.tcgetattr(slave) == before  # as it was: line mode, echo
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(slave)
        os.close(master)


def test_piped_top_prints_plain_frames_one_after_another(spoke_server: ServerProcess) -> None:
    """Not a terminal (a pipe, a log): frames of plain text, no escape codes, like top -b;
    Ctrl-C ends it cleanly."""
    # SIGINT as a shell gives it: pytest-xdist's workers ignore it, and children inherit that.
    proc = subprocess.Popen([sys.executable, "-m", "spokefs.cli", "top", spoke_server.url,
                             "--interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    out = b""
    try:
        end = time.monotonic() + 60
        while out.count(b"spokefs top  ") < 2 and time.monotonic() < end:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                out += os.read(proc.stdout.fileno(), 65536)
        assert out.count(b"spokefs top  ") >= 2, out[-2000:]
        assert b"\x1b" not in out
        first, second = out.decode().split("\n\n")[:2]
        assert first.startswith(f"spokefs top  {spoke_server.url}") and "hit ratio" in first
        assert "(last " in second  # the second frame has rates over the first
        proc.send_signal(signal.SIGINT)
        # Read on while it ends: a frame it is writing into a full pipe must not hold it.
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_top_of_a_hub_is_a_clear_error(hub_server: ServerProcess, tmp_path: Path) -> None:
    r = cli("top", hub_server.url, "--once")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "a spoke" in r.stderr


def test_top_shows_the_steps_a_job_reports(spoke_server: ServerProcess) -> None:
    base = spoke_server.url
    Client(base).post_json("/v1/datasets/ds/jobs/train/steps",
                           {"steps": [[0.1, 0.9], [0.0, 1.0]]})
    r = cli("top", base, "--json")
    assert r.returncode == 0, r.stderr
    (job,) = json.loads(r.stdout)["training"]
    (want,) = Client(base).get_json("/v1/status")["jobs"]
    assert job == {k: want[k] for k in ("dataset", "job", "steps", "data_wait_share",
                                        "utilisation")}
    assert job["steps"] == 2
    text = cli("top", base, "--once").stdout
    assert "training job" in text and "ds/train" in text
    assert f"{100 * want['data_wait_share']:.1f}%" in text
