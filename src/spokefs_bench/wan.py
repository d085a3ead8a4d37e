"""``spokefs bench wan``: does the WAN emulator delay, cap and keep up, and what does it cost?

Serves a temp file from a small in-process aiohttp server, puts ``spokefs wan`` in front of
it as a separate process, and measures through it with an aiohttp client:

- one 4 MiB range GET on a new connection and on a warm one (must take at least one rtt);
- N concurrent 4 MiB GETs on warm connections: aggregate throughput against the cap, over
  the transfer (wall clock less the one rtt a request needs before any byte can come back)
  and over the plain wall clock (requests sent to last byte);
- the same with the cap and delay switched off, to show the emulator's own ceiling here;
- the proxy's CPU seconds per GB moved, read from its ``/status`` (``time.process_time()``
  inside the proxy process: user + system CPU of that process only, control requests included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from spokefs.errors import SpokeError
from spokefs.procs import Service
from spokefs.units import format_size, parse_duration, parse_rate, parse_size
from spokefs.wan.cli import _arg
from spokefs_bench.common import machine, table, write_json

MIB = 1024 * 1024
THROUGHPUT_GOAL = 0.95  # share of the cap that concurrent streams should reach


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wan", help="measure the WAN link emulator: latency, shared cap, CPU/GB",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where to write results.json")
    p.add_argument("--rtt", type=_arg(parse_duration), default=0.06, metavar="DURATION",
                   help="round-trip time to emulate (default: 60ms)")
    p.add_argument("--bandwidth", type=_arg(parse_rate), default=200e6, metavar="RATE",
                   help="cap per direction (default: 200MB/s)")
    p.add_argument("--size", type=_arg(parse_size), default=64 * MIB, metavar="SIZE",
                   help="size of the served file (default: 64MiB)")
    p.add_argument("--get-size", type=_arg(parse_size), default=4 * MIB, metavar="SIZE",
                   help="bytes per range GET (default: 4MiB)")
    p.add_argument("--streams", type=int, default=32, help="concurrent GETs (default: 32)")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of concurrent GETs to average (default: 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.get_size > args.size:
        raise SpokeError(f"--get-size {args.get_size} is larger than --size {args.size}")
    results = asyncio.run(_bench(args))
    path = write_json(args.out, results)
    _print_table(results)
    print(f"wrote {path}")
    return 0


# -- the parts -------------------------------------------------------------------------------
async def _file_server(path: Path) -> tuple[web.AppRunner, int]:
    async def data(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path)  # answers Range requests, with sendfile

    app = web.Application()
    app.router.add_get("/data", data)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def _get(http: aiohttp.ClientSession, url: str, start: int,
               length: int) -> tuple[float, float, int]:
    """One range GET: the loop times it was sent and fully read, and the bytes received."""
    loop = asyncio.get_running_loop()
    sent, got = loop.time(), 0
    headers = {"Range": f"bytes={start}-{start + length - 1}"}
    async with http.get(url, headers=headers) as resp:
        if resp.status != 206:
            raise SpokeError(f"range GET answered {resp.status}, expected 206")
        async for chunk in resp.content.iter_any():
            got += len(chunk)
    if got != length:
        raise SpokeError(f"range GET returned {got} bytes, expected {length}")
    return sent, loop.time(), got


async def _control(http: aiohttp.ClientSession, url: str, path: str,
                   body: dict[str, Any] | None = None) -> dict[str, Any]:
    method = http.get if path == "/status" else http.post
    async with method(url + path, json=body) as resp:
        resp.raise_for_status()
        return await resp.json()


async def _concurrent(http: aiohttp.ClientSession, data_url: str, control_url: str,
                      args: argparse.Namespace, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of ``args.streams`` concurrent GETs on warm connections."""
    await asyncio.gather(*(_get(http, data_url, 0, 1) for _ in range(args.streams)))  # warm
    before = await _control(http, control_url, "/status")
    moved = wall = 0.0
    for r in range(rounds):
        offsets = [((r * args.streams + i) * args.get_size) % (args.size - args.get_size + 1)
                   for i in range(args.streams)]
        gets = await asyncio.gather(*(_get(http, data_url, o, args.get_size) for o in offsets))
        moved += sum(g[2] for g in gets)
        wall += max(g[1] for g in gets) - min(g[0] for g in gets)
    # No response byte can arrive before one rtt: the rest of the wall clock is the transfer.
    transfer = wall - rounds * before["rtt"]
    after = await _control(http, control_url, "/status")
    proxied = (after["bytes_up"] + after["bytes_down"]
               - before["bytes_up"] - before["bytes_down"])
    cpu = after["process_cpu_s"] - before["process_cpu_s"]
    return {"streams": args.streams, "rounds": rounds, "bytes": int(moved),
            "transfer_Bps": moved / transfer, "wall_Bps": moved / wall,
            "proxy_cpu_s": cpu, "proxy_bytes": proxied,
            "proxy_cpu_s_per_GB": cpu / (proxied / 1e9)}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spokefs-bench-wan-") as tmp:
        path = Path(tmp) / "data.bin"
        block = os.urandom(MIB)
        with path.open("wb") as f:
            for _ in range(-(-args.size // MIB)):
                f.write(block)
            f.truncate(args.size)
        runner, port = await _file_server(path)
        proxy = Service(["wan", "--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{port}",
                         "--rtt", repr(args.rtt), "--bandwidth", repr(args.bandwidth)])
        try:
            await asyncio.to_thread(proxy.start)
            results = await _measure(args, f"{proxy.url}/data", proxy.control)
        finally:
            await asyncio.to_thread(proxy.stop)
            await runner.cleanup()
    assert proxy.proc is not None
    results["proxy_exit_code"] = proxy.proc.returncode  # 0: shut down cleanly on SIGTERM
    return results


async def _measure(args: argparse.Namespace, url: str, control_url: str) -> dict[str, Any]:
    cold, warm = [], []
    for _ in range(3):  # a new connection per GET: pays the handshake too
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as h:
            sent, end, _ = await _get(h, url, 0, args.get_size)
            cold.append(end - sent)
    connector = aiohttp.TCPConnector(limit=args.streams)
    async with aiohttp.ClientSession(connector=connector) as http:
        await _get(http, url, 0, 1)
        for _ in range(3):
            sent, end, _ = await _get(http, url, 0, args.get_size)
            warm.append(end - sent)
        capped = await _concurrent(http, url, control_url, args, args.repeat)
        await _control(http, control_url, "/set", {"rtt": 0, "bandwidth": 0})
        uncapped = await _concurrent(http, url, control_url, args, args.repeat)
    latency = statistics.median(warm)
    return {
        "config": {"rtt_s": args.rtt, "bandwidth_Bps": args.bandwidth, "file_bytes": args.size,
                   "get_bytes": args.get_size, "streams": args.streams},
        "machine": machine(),
        "single_get_cold_s": statistics.median(cold),
        "single_get_warm_s": latency,
        "concurrent": capped,
        "uncapped": uncapped,
        "checks": {
            "latency_at_least_rtt": min(cold + warm) >= args.rtt,
            "throughput_at_least_95pct_of_cap":
                capped["transfer_Bps"] >= THROUGHPUT_GOAL * args.bandwidth,
        },
    }


def _print_table(r: dict[str, Any]) -> None:
    cfg, cap, free = r["config"], r["concurrent"], r["uncapped"]
    bw = cfg["bandwidth_Bps"]
    size = format_size(cfg["get_bytes"])
    rows = [
        (f"single {size} GET, new connection", f"{r['single_get_cold_s'] * 1e3:.1f} ms",
         "handshake + request rtt + transfer"),
        (f"single {size} GET, warm connection", f"{r['single_get_warm_s'] * 1e3:.1f} ms",
         f">= rtt {cfg['rtt_s'] * 1e3:.0f} ms: "
         + ("ok" if r["checks"]["latency_at_least_rtt"] else "TOO FAST")),
        (f"{cap['streams']} concurrent GETs, transfer", f"{cap['transfer_Bps'] / 1e6:.1f} MB/s",
         f"{cap['transfer_Bps'] / bw:.1%} of the {bw / 1e6:.0f} MB/s cap (goal >= 95%; "
         "wall clock less one rtt)"),
        (f"{cap['streams']} concurrent GETs, wall clock", f"{cap['wall_Bps'] / 1e6:.1f} MB/s",
         f"{cap['wall_Bps'] / bw:.1%} of the cap (includes the request's rtt)"),
        ("proxy CPU per GB, capped", f"{cap['proxy_cpu_s_per_GB']:.3f} s/GB",
         "process_time() of the proxy process"),
        ("uncapped, rtt 0: throughput", f"{free['wall_Bps'] / 1e6:.1f} MB/s",
         f"client, server and proxy share {r['machine']['cpus']} CPUs"),
        ("uncapped: proxy CPU per GB", f"{free['proxy_cpu_s_per_GB']:.3f} s/GB",
         f"~{1 / free['proxy_cpu_s_per_GB']:.2f} GB/s per core if CPU-bound"),
    ]
    print(table([list(row) for row in rows], ["measure", "value", "note"]))
