"""The WAN link emulator: its timing maths with a fake clock, then the proxy on real sockets.

The maths (``spokefs.wan.link``) is checked exactly, on a fake clock. The socket tests that
check the proxy applies it must run in real time (its timers are the event loop's) and are
marked ``timing``. Each measures a bound that fails when the emulated effect is missing (a
delay, a cap, a full pipe) and waits on events, not on sleeps. A lower bound is the behaviour
(not before the delay) and stays tight; an upper bound only has to tell the effect from its
absence, and leaves a loaded 2-core machine seconds of room.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from spokefs.errors import ConfigError
from spokefs.wan import LinkConfig, WanLink, WanLinkThread
from spokefs.wan.cli import make_link, register
from spokefs.wan.link import MAX_IN_FLIGHT, QUEUE_S, Link, parse_address

MB = 1_000_000


# -- the timing maths, no sockets ------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_link_maths(**settings: object) -> tuple[Link, FakeClock]:
    clock = FakeClock()
    return Link(LinkConfig().updated(**settings), clock=clock, rand=lambda: 0.0), clock


def open_warm(link: Link, clock: FakeClock):
    """A connection whose handshake is over, as most of these tests want."""
    up, down = link.open()
    clock.now += 2 * link.config.rtt
    return up, down


def test_one_way_delay_is_half_the_rtt() -> None:
    link, clock = make_link_maths(rtt="100ms")
    up, down = open_warm(link, clock)
    t = clock.now
    assert up.send(1000) == pytest.approx(t + 0.05)
    assert down.send(1000) == pytest.approx(t + 0.05)


def test_handshake_costs_one_round_trip() -> None:
    link, clock = make_link_maths(rtt="100ms")
    t = clock.now
    up, down = link.open()
    # SYN, SYN-ACK, then the request's own one-way trip: 1.5 rtt to the server.
    assert up.send(10) == pytest.approx(t + 0.15)
    assert down.send(10) == pytest.approx(t + 0.1)


def test_bandwidth_serialises_chunks_and_the_pipe_stays_full() -> None:
    link, clock = make_link_maths(rtt="200ms", bandwidth="10MB/s")
    up, _ = open_warm(link, clock)
    t = clock.now
    # Ten 1 MB chunks arriving together leave 0.1 s apart, each then flies 0.1 s: no
    # stop-and-wait (that would add a round trip per chunk).
    releases = [up.send(MB) for _ in range(10)]
    assert releases == pytest.approx([t + 0.1 * (i + 1) + 0.1 for i in range(10)])


def test_the_cap_is_shared_by_all_connections_of_a_direction() -> None:
    link, clock = make_link_maths(bandwidth="10MB/s")
    a, _ = open_warm(link, clock)
    b, _ = open_warm(link, clock)
    (c, d), t = link.open(), clock.now
    assert a.send(MB) == pytest.approx(t + 0.1)
    assert b.send(MB) == pytest.approx(t + 0.2)  # waits for a's megabyte
    assert d.send(MB) == pytest.approx(t + 0.1)  # the other direction has its own wire
    clock.now += 1.0  # the wire went idle: no credit for idle time
    assert a.send(MB) == pytest.approx(clock.now + 0.1)
    del c


def test_jitter_delays_but_never_reorders() -> None:
    clock = FakeClock()
    draws = iter([1.0, 0.0, 1.0])
    link = Link(LinkConfig(rtt=0.0, jitter=0.02), clock=clock, rand=lambda: next(draws))
    up, _ = link.open()
    first = up.send(10)
    second = up.send(10)  # drew no jitter, but may not overtake the first
    clock.now += 0.001
    third = up.send(10)
    assert first == pytest.approx(100.02)
    assert second == first
    assert third == pytest.approx(100.021)


def test_window_credit_returns_one_way_after_delivery() -> None:
    link, clock = make_link_maths(rtt="100ms", window="100KB")
    up, _ = open_warm(link, clock)
    t = clock.now
    assert up.room() == 100_000
    release = up.send(60_000)
    assert up.room() == 40_000 and up.wake_at() is None
    clock.now = t + 0.01
    up.send(40_000)
    assert up.room() == 0
    assert up.wake_at() == pytest.approx(release + 0.05) == pytest.approx(t + 0.1)  # the ACK
    clock.now = t + 0.1
    assert up.room() == 60_000 and up.wake_at() is None
    clock.now = t + 0.11
    assert up.room() == 100_000


def test_without_a_window_memory_bounds_in_flight_until_delivery() -> None:
    link, clock = make_link_maths(rtt="100ms")
    up, _ = open_warm(link, clock)
    release = up.send(MAX_IN_FLIGHT)
    assert up.room() == 0 and up.wake_at() == pytest.approx(release)


def test_a_flow_stops_reading_while_it_has_booked_the_wire_ahead() -> None:
    link, clock = make_link_maths(bandwidth="10MB/s")
    up, _ = open_warm(link, clock)
    t = clock.now
    up.send(10_000)  # 1 ms on the wire: may read on
    assert up.wake_at() is None
    up.send(MB)  # booked 101 ms ahead: wait until only QUEUE_S of it is left
    assert up.wake_at() == pytest.approx(t + 0.101 - QUEUE_S)
    clock.now = t + 0.101 - QUEUE_S
    assert up.wake_at() is None


def test_eof_follows_the_last_byte() -> None:
    link, clock = make_link_maths(rtt="100ms", bandwidth="10MB/s")
    up, _ = open_warm(link, clock)
    last = up.send(MB)
    assert up.send_eof() == pytest.approx(last)
    clock.now += 1.0
    assert up.send_eof() == pytest.approx(clock.now + 0.05)


def test_a_new_setting_applies_to_the_next_chunk_and_never_reorders() -> None:
    link, clock = make_link_maths()
    up, _ = open_warm(link, clock)
    t = clock.now
    assert up.send(10) == pytest.approx(t)  # no delay yet
    link.config = link.config.updated(rtt="200ms")  # what WanLink.set does, live
    slow = up.send(10)
    assert slow == pytest.approx(t + 0.1)
    link.config = link.config.updated(rtt=0)
    assert up.send(10) == slow  # queued behind the slow chunk, not ahead of it
    clock.now += 1.0
    assert up.send(10) == pytest.approx(clock.now)


def test_settings_parse_units_and_numbers() -> None:
    cfg = LinkConfig().updated(rtt="60ms", bandwidth="400MB/s", jitter=0.002, window="1MiB")
    assert cfg == LinkConfig(rtt=0.06, bandwidth=400e6, jitter=0.002, window=1024 * 1024)
    assert cfg.updated(bandwidth=0, window=0) == LinkConfig(rtt=0.06, jitter=0.002)
    assert cfg.updated(bandwidth="1Gbit/s").bandwidth == 125e6
    for bad in ({"rtt": "fast"}, {"rtt": -1}, {"latency": 1}, {"bandwidth": True}):
        with pytest.raises(ConfigError):
            cfg.updated(**bad)


def test_addresses() -> None:
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_address("[::1]:8080") == ("::1", 8080)
    assert parse_address(":9") == ("127.0.0.1", 9)
    with pytest.raises(ConfigError):
        parse_address("localhost")


def test_cli_parses_units() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["wan", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:9000",
                              "--rtt", "60ms", "--bandwidth", "400MB/s", "--jitter", "2ms",
                              "--window", "4MiB"])
    link = make_link(args)
    assert link.config == LinkConfig(rtt=0.06, bandwidth=400e6, jitter=0.002,
                                     window=4 * 1024 * 1024)
    assert link.upstream == ("127.0.0.1", 9000) and link.listen == ("127.0.0.1", 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["wan", "--upstream", "127.0.0.1:1", "--rtt", "soon"])


# -- the proxy on real sockets ---------------------------------------------------------------
async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo lines; a line "sink N" reads N bytes and answers "got N"; "send N" sends N bytes."""
    try:
        while line := await reader.readline():
            words = line.split()
            if words[:1] == [b"sink"]:
                await reader.readexactly(int(words[1]))
                writer.write(b"got %d\n" % int(words[1]))
            elif words[:1] == [b"send"]:
                writer.write(b"x" * int(words[1]))
            else:
                writer.write(line)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, int]]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[:2]
    server.close()


@pytest.fixture
async def wan(upstream: tuple[str, int]) -> AsyncIterator[WanLink]:
    link = WanLink(upstream)
    await link.start()
    yield link
    await link.stop()


async def connect(link: WanLink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", link.port, limit=16 * MB)


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              line: bytes) -> float:
    """Send a line, wait for its answer line; return the seconds it took."""
    t0 = time.perf_counter()
    writer.write(line)
    await writer.drain()
    await asyncio.wait_for(reader.readline(), 10)
    return time.perf_counter() - t0


# Real time: the delay is applied by the proxy's event-loop timers.
@pytest.mark.timing
async def test_delay_applies_to_requests_and_to_new_connections(wan: WanLink) -> None:
    wan.set(rtt="100ms")
    t0 = time.perf_counter()
    reader, writer = await connect(wan)
    await ask(reader, writer, b"hello\n")
    first = time.perf_counter() - t0
    again = await ask(reader, writer, b"hello\n")
    writer.close()
    assert 0.2 <= first < 3.0  # one round trip to connect, one for the request
    assert 0.1 <= again < 3.0


# Real time: the cap is paced by the proxy's event-loop timers.
@pytest.mark.timing
@pytest.mark.parametrize("direction", ["up", "down"])
async def test_bandwidth_cap_holds(wan: WanLink, direction: str) -> None:
    wan.set(bandwidth="20MB/s")
    reader, writer = await connect(wan)
    t0 = time.perf_counter()
    if direction == "up":
        writer.write(b"sink %d\n" % (10 * MB) + b"x" * (10 * MB))
        await asyncio.wait_for(reader.readline(), 10)
    else:
        writer.write(b"send %d\n" % (10 * MB))
        await asyncio.wait_for(reader.readexactly(10 * MB), 10)
    elapsed = time.perf_counter() - t0
    writer.close()
    assert 0.45 <= elapsed < 5.0  # 10 MB at 20 MB/s is 0.5 s; uncapped it is ~10 ms
    assert getattr(wan.stats, f"bytes_{direction}") >= 10 * MB


# Real time: two real connections through the proxy's one paced wire.
@pytest.mark.timing
async def test_the_cap_is_shared_between_connections(wan: WanLink) -> None:
    wan.set(bandwidth="20MB/s")
    conns = [await connect(wan) for _ in range(2)]

    async def pull(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"send %d\n" % (5 * MB))
        await asyncio.wait_for(reader.readexactly(5 * MB), 10)

    t0 = time.perf_counter()
    await asyncio.gather(*(pull(r, w) for r, w in conns))
    elapsed = time.perf_counter() - t0
    for _, w in conns:
        w.close()
    assert 0.45 <= elapsed < 5.0  # 10 MB in all; a per-connection cap would take 0.25 s


# Real time: whether the proxy keeps reading while its chunks fly shows only on a real clock.
@pytest.mark.timing
async def test_the_pipe_stays_full(wan: WanLink) -> None:
    wan.set(rtt="200ms", bandwidth="80MB/s")
    reader, writer = await connect(wan)
    await ask(reader, writer, b"warm\n")  # pay the handshake first
    t0 = time.perf_counter()
    writer.write(b"sink %d\n" % (8 * MB) + b"x" * (8 * MB))
    await asyncio.wait_for(reader.readline(), 10)
    elapsed = time.perf_counter() - t0
    writer.close()
    # 0.1 s on the wire plus one round trip: ~0.3 s. Stop-and-wait (a one-way trip per read
    # of at most 256 KiB, 31 or more of them) would take 3.3 s or more.
    assert 0.28 <= elapsed < 2.0


# Real time: the window's ACK wait is the proxy's event-loop timer.
@pytest.mark.timing
async def test_window_limits_a_single_stream(wan: WanLink) -> None:
    wan.set(rtt="50ms", window="128KiB")
    reader, writer = await connect(wan)
    await ask(reader, writer, b"warm\n")
    t0 = time.perf_counter()
    writer.write(b"sink %d\n" % (1024 * 1024) + b"x" * (1024 * 1024))
    await asyncio.wait_for(reader.readline(), 10)
    elapsed = time.perf_counter() - t0
    writer.close()
    # 8 windows, each waiting a round trip for its ACK: ~0.4 s; without a window ~0.05 s.
    assert 0.3 <= elapsed < 5.0


async def test_jitter_keeps_bytes_in_order(wan: WanLink) -> None:
    wan.set(jitter="20ms")
    reader, writer = await connect(wan)
    payload = b"".join(b"%07d%s\n" % (i, b"." * 72) for i in range(20_000))  # 1.6 MB
    writer.write(payload)
    echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    writer.close()
    assert echoed == payload


# Real time: the reset after a cut is the proxy's event-loop timer.
@pytest.mark.timing
async def test_cut_refuses_new_stalls_open_then_resets(wan: WanLink) -> None:
    reader, writer = await connect(wan)
    await ask(reader, writer, b"before\n")
    wan.cut(reset_after=0.5)
    t_cut = time.perf_counter()

    refused_r, refused_w = await connect(wan)  # the kernel accepts; the emulator resets it
    with pytest.raises(ConnectionError):
        refused_w.write(b"hi\n")
        if not await asyncio.wait_for(refused_r.read(1), 10):
            raise ConnectionResetError("closed")
    refused_w.close()

    up_before = wan.stats.bytes_up
    writer.write(b"during\n")
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        line = await asyncio.wait_for(reader.readline(), 10)
        if not line:
            raise ConnectionResetError("closed")
    assert time.perf_counter() - t_cut >= 0.45  # stalled until reset_after, not closed early
    assert wan.stats.bytes_up == up_before  # nothing crossed while cut
    assert wan.stats.refused == 1 and wan.stats.resets == 1
    writer.close()

    wan.restore()
    reader, writer = await connect(wan)
    assert await ask(reader, writer, b"after\n") < 3.0
    writer.close()
    assert wan.active_connections <= 1


# Real time: the stall lasts until a timer on the proxy's event loop restores the link.
@pytest.mark.timing
async def test_restore_before_reset_delivers_what_was_stalled(wan: WanLink) -> None:
    reader, writer = await connect(wan)
    await ask(reader, writer, b"before\n")
    wan.cut(reset_after=5)
    writer.write(b"held\n")
    await writer.drain()
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, wan.restore)
    t0 = time.perf_counter()
    assert await asyncio.wait_for(reader.readline(), 10) == b"held\n"
    assert time.perf_counter() - t0 >= 0.25
    writer.close()


# Real time: the new rtt must reach the proxy's timers on an open connection.
@pytest.mark.timing
async def test_set_changes_rtt_live_through_the_control_port(wan: WanLink) -> None:
    reader, writer = await connect(wan)
    assert await ask(reader, writer, b"fast\n") < 0.2  # not yet the rtt set below
    base = f"http://127.0.0.1:{wan.control_port}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/set", json={"rtt": "200ms"}) as r:
            assert r.status == 200
            assert (await r.json())["rtt"] == 0.2
        assert 0.2 <= await ask(reader, writer, b"slow\n") < 3.0
    writer.close()


async def test_control_port_sets_reports_and_cuts(wan: WanLink) -> None:
    reader, writer = await connect(wan)
    await ask(reader, writer, b"fast\n")
    base = f"http://127.0.0.1:{wan.control_port}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/set", json={"rtt": "1ms", "bandwidth": "1GB/s"}) as r:
            assert r.status == 200
            assert (await r.json())["rtt"] == 0.001
        await ask(reader, writer, b"slow\n")
        async with http.get(f"{base}/status") as r:
            status = await r.json()
        assert status["bandwidth"] == 1e9 and status["connections"] == 1
        assert status["bytes_up"] == status["bytes_down"] == len(b"fast\nslow\n")
        assert status["active_connections"] == 1 and status["cut"] is False
        async with http.post(f"{base}/reset-counters") as r:
            assert (await r.json())["bytes_up"] == 0
        async with http.post(f"{base}/set", json={"rtt": "soon"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "config"
        async with http.post(f"{base}/cut", json={"reset_after": "2s"}) as r:
            assert (await r.json())["cut"] is True
        async with http.post(f"{base}/restore") as r:
            assert (await r.json())["cut"] is False
    writer.close()


async def test_upstream_down_resets_the_client() -> None:
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with WanLink(("127.0.0.1", port), control=None) as link:
        reader, writer = await connect(link)
        with pytest.raises(ConnectionError):
            if not await asyncio.wait_for(reader.read(1), 2):
                raise ConnectionResetError("closed")
        writer.close()


# Real time: the delay is applied by timers on the thread's event loop.
@pytest.mark.timing
def test_in_a_thread_for_synchronous_callers() -> None:
    with (socket.create_server(("127.0.0.1", 0)) as server,
          WanLinkThread(server.getsockname(), rtt="100ms", control=None) as wan):
        t0 = time.perf_counter()
        client = socket.create_connection(("127.0.0.1", wan.port))
        peer, _ = server.accept()
        client.sendall(b"ping")
        assert peer.recv(4) == b"ping"
        assert time.perf_counter() - t0 >= 0.15  # handshake + one way
        wan.set(rtt=0)
        assert wan.status()["rtt"] == 0
        client.close()
        peer.close()


def test_command_prints_its_address_and_stops_cleanly_on_sigterm() -> None:
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spokefs.wan", "--listen", "127.0.0.1:0",
         "--upstream", "127.0.0.1:9", "--rtt", "60ms",
         "--bandwidth", "400MB/s"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        words = line.split()
        assert words[:4] == ["spokefs", "wan", "listening", "on"] and words[5] == "control"
        control = words[6]
        with urllib.request.urlopen(f"{control}/status", timeout=5) as response:
            status = json.loads(response.read())
        assert status["rtt"] == 0.06 and status["bandwidth"] == 400e6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
