"""Logs: plain by default, JSON lines with ``--log-format json`` or SPOKEFS_LOG_FORMAT=json,
and one line for each notable event (link down and up, deadline exceeded, warm-up done,
eviction storm)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest
import xxhash

import spokefs
from servers import ServerProcess, free_port, make_dataset
from spokefs.cache.store import BlockStore
from spokefs.cache.storm import StormWatch
from spokefs.client.control import SpokeControl
from spokefs.errors import SpokeError
from spokefs.logs import JsonFormatter
from spokefs.policy import make_policy


def test_json_formatter_one_object_per_line_with_extra_fields() -> None:
    rec = logging.LogRecord("spokefs.x", logging.WARNING, __file__, 1, "link %s is %s",
                            ("up", "fine\nreally"), None)
    rec.event = "link_up"
    rec.path = Path("/a")
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["level"] == "WARNING" and doc["logger"] == "spokefs.x"
    assert doc["message"] == "link up is fine\nreally"
    assert doc["event"] == "link_up" and doc["path"] == "/a"
    assert doc["time"].endswith("Z") and "T" in doc["time"]


def test_storm_watch_reports_once_a_burst_passes_half_the_capacity() -> None:
    w = StormWatch(share=0.5, window_s=60, quiet_s=300)
    cap = 1000
    assert w.evicted(100, 0.0, cap) is None  # ordinary churn
    assert w.evicted(100, 70.0, cap) is None  # the first left the window
    assert w.evicted(350, 80.0, cap) is None  # 450 of 1000 in the last minute
    assert w.evicted(100, 90.0, cap) == 550  # past half: the storm, one report
    assert w.evicted(300, 100.0, cap) is None  # quiet for a while
    assert w.evicted(600, 400.0, cap) == 600  # a later storm is reported again


def test_store_logs_one_eviction_storm_and_counts_prefetches_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> list[int]:
        loop = asyncio.get_running_loop()
        store = BlockStore(tmp_path / "c", 1 << 20, make_policy("lru"), fsync=False)
        await asyncio.to_thread(store.open, loop.call_soon_threadsafe)
        used: list[int] = []
        store.events.on_prefetch_used = used.append
        try:
            for i in range(24):  # 3 MiB through a 1 MiB cache: evictions at once
                data = bytes([i]) * (128 << 10)
                res = store.reserve((f"v{i}", 0), len(data), "ds")
                assert res is not None
                done: asyncio.Future[bool] = loop.create_future()
                store.write(res, memoryview(data), xxhash.xxh3_128_digest(data),
                            done.set_result)
                assert await done
                store.prefetched((f"v{i}", 0), len(data))
            store.touch(("v23", 0))  # read: a prefetch used
            store.touch(("v23", 0))  # read again: counted once
            store.touch(("v0", 0))  # evicted unread: never counted
        finally:
            await asyncio.to_thread(store.close)
        return used

    with caplog.at_level(logging.WARNING, logger="spokefs.cache.store"):
        used = asyncio.run(go())
    assert used == [128 << 10]
    storms = [r for r in caplog.records if getattr(r, "event", None) == "eviction_storm"]
    assert len(storms) == 1 and storms[0].evicted_bytes >= 512 << 10


def json_lines(proc: ServerProcess) -> list[dict]:
    return [json.loads(line) for line in list(proc.lines) if line.startswith("{")]


def wait_event(proc: ServerProcess, event: str, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for doc in json_lines(proc):
            if doc.get("event") == event:
                return doc
        time.sleep(0.05)
    raise AssertionError(f"no {event} line; output:\n{''.join(proc.lines[-20:])}")


def test_json_lines_and_notable_events(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "ds", n_small=8)
    port = free_port()
    hub_args = ("hub", "serve", str(data), "--port", str(port), "--state-dir",
                str(tmp_path / "hubstate"))
    hub = ServerProcess(*hub_args, env={"SPOKEFS_LOG_FORMAT": "json"}).start()
    spoke = ServerProcess("--log-format", "json", "spoke", "serve", "--upstream", hub.url,
                          "--cache-dir", str(tmp_path / "cache"), "--cache-size", "64MiB",
                          "--port", "0", "--no-fsync", "--deadline", "2s", "--workers", "1")
    try:
        spoke.start()
        for proc in (hub, spoke):  # the env var and the flag: both log JSON lines
            docs = json_lines(proc)
            assert docs, proc.lines
            for doc in docs:
                assert {"time", "level", "logger", "message"} <= set(doc)
        assert not [line for line in spoke.lines if line.startswith("20")]  # no plain lines

        SpokeControl(f"{spoke.url}/ds").warm(prefix="class1", wait=True, progress=False)
        done = wait_event(spoke, "warmup_done")
        assert done["level"] == "INFO" and done["dataset"] == "ds" and done["failed_blocks"] == 0

        f = spokefs.open(f"{spoke.url}/ds/shards/shard-000.tar")  # resolved while the hub is up
        hub.stop()
        with pytest.raises(SpokeError):
            f.read(1000)
        down = wait_event(spoke, "link_down")
        assert down["level"] == "WARNING" and down["upstream"] == hub.url
        assert wait_event(spoke, "deadline_exceeded")["level"] == "WARNING"
        assert not [d for d in json_lines(spoke) if d.get("event") == "link_up"]

        hub = ServerProcess(*hub_args, env={"SPOKEFS_LOG_FORMAT": "json"}).start()
        with spokefs.open(f"{spoke.url}/ds/shards/shard-000.tar") as g:
            assert len(g.read(1000)) == 1000
        up = wait_event(spoke, "link_up")
        assert up["level"] == "INFO"
        events = [d.get("event") for d in json_lines(spoke)]
        assert events.count("link_down") == 1 and events.count("link_up") == 1
    finally:
        spoke.stop()
        hub.stop()


def test_plain_logs_by_default(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "ds", n_small=2, big_sizes=())
    with ServerProcess("hub", "serve", str(data), "--port", "0", "--state-dir",
                       str(tmp_path / "s"), env={"SPOKEFS_LOG_FORMAT": ""}) as hub:
        logged = [line for line in hub.lines if " WARNING " in line or " INFO " in line]
        assert logged and not [line for line in hub.lines if line.startswith("{")]
