"""Operator and client control of a spoke: warm-up, residency, orders, purge, status."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import urllib3

from servers import spoke
from spokefs.client.control import SpokeControl
from spokefs.errors import BadRequest
from test_spoke import metric, read_all

http = urllib3.PoolManager(retries=False)


def test_warm_then_reads_cross_nothing(spoke_server, dataset: Path) -> None:
    ctl = SpokeControl(f"{spoke_server.url}/ds")
    before = ctl.residency(prefix="")
    assert before["fraction"] == 0 and before["files"] == 23
    done = ctl.warm(prefix="", wait=True, progress=False, timeout=30)
    assert done["fraction"] == 1.0 and done["resident_files"] == 23
    fetched = metric(spoke_server.url, "spokefs_upstream_bytes_total")
    read_all(spoke_server.url, dataset)
    assert metric(spoke_server.url, "spokefs_upstream_bytes_total") == fetched


def test_warm_cli_with_progress(spoke_server, dataset: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "warm",
                        f"{spoke_server.url}/ds/class1",
                        "--wait", "--timeout", "30s"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "resident: 5/5 files" in r.stdout
    ctl = SpokeControl(f"{spoke_server.url}/ds")
    assert ctl.residency(prefix="class1")["fraction"] == 1.0
    assert ctl.residency(prefix="class2")["fraction"] == 0.0


def test_order_announcement(spoke_server, dataset: Path) -> None:
    ctl = SpokeControl(f"{spoke_server.url}/ds", job="j1")
    paths = sorted(str(p.relative_to(dataset)) for p in dataset.rglob("*.jpg"))
    r = ctl.announce(0, paths=paths[::-1])
    assert r["files"] == len(paths)
    with pytest.raises(BadRequest, match="not in"):
        ctl.announce(1, paths=["no/such.jpg"])
    ctl.epoch(1)
    ctl.end()


def test_purge_and_status(spoke_server, dataset: Path) -> None:
    read_all(spoke_server.url, dataset)
    assert metric(spoke_server.url, "spokefs_cache_bytes") > 0
    out = subprocess.run([sys.executable, "-m", "spokefs.cli", "status", spoke_server.url],
                         capture_output=True, text=True, timeout=30).stdout
    assert "hit ratio" in out and "upstream" in out
    r = http.request("POST", f"{spoke_server.url}/v1/purge", body=json.dumps({"dataset": "ds"}))
    assert r.status == 200 and json.loads(r.data)["freed_bytes"] > 0
    assert metric(spoke_server.url, "spokefs_cache_bytes") == 0
    read_all(spoke_server.url, dataset)  # and it refills


def test_bad_control_requests(spoke_server) -> None:
    base = spoke_server.url
    r = http.request("POST", f"{base}/v1/datasets/ds/warm", body=b"{not json")
    assert r.status == 400
    r = http.request("POST", f"{base}/v1/datasets/ds/residency",
                     body=json.dumps({"prefix": "nope"}))
    assert r.status == 400 and "nope" in json.loads(r.data)["error"]["message"]
    r = http.request("POST", f"{base}/v1/datasets/ds/jobs/j/order",
                     body=json.dumps({"indexes": [10**9]}))
    assert r.status == 400


# -- every value a control body carries is checked ---------------------------------------------

V = "0" * 32  # a well-formed version id: these bodies fail on another field first
ORDER, EPOCH = "/v1/datasets/ds/jobs/j/order", "/v1/datasets/ds/jobs/j/epoch"
WARM, RESIDENCY = "/v1/datasets/ds/warm", "/v1/datasets/ds/residency"
LOCATE, READS = "/v1/datasets/ds/locate", "/v1/datasets/ds/reads"
PURGE, COUNTS = "/v1/purge", "/v1/workers/counts"

# (route, body, status, what the message names). Each of these was once a 500, a 200 that
# should not have been (a bool as an index), or unbounded work.
BAD_BODIES: list[tuple[str, object, int, str]] = [
    (ORDER, [], 400, "JSON object"),
    (ORDER, "paths", 400, "JSON object"),
    (ORDER, None, 400, "JSON object"),
    (ORDER, {"paths": "class0/img0000.jpg"}, 400, '"paths"'),
    (ORDER, {"paths": [{"path": "class0/img0000.jpg"}]}, 400, '"paths"'),
    (ORDER, {"paths": [[["class0"]]]}, 400, '"paths"'),
    (ORDER, {"paths": [7]}, 400, '"paths"'),
    (ORDER, {"indexes": "0"}, 400, '"indexes"'),
    (ORDER, {"indexes": [0, True]}, 400, '"indexes"'),
    (ORDER, {"indexes": [0.0]}, 400, '"indexes"'),
    (ORDER, {"indexes": [-1]}, 400, '"indexes"'),
    (ORDER, {"indexes": [0], "epoch": "1"}, 400, '"epoch"'),
    (ORDER, {"indexes": [0], "epoch": True}, 400, '"epoch"'),
    (ORDER, {"indexes": [0], "epoch": -1}, 400, '"epoch"'),
    (ORDER, {"indexes": [0], "epoch": 2**64}, 400, '"epoch"'),
    (ORDER, {"indexes": [0], "ranges": "0-10"}, 400, '"ranges"'),
    (ORDER, {"indexes": [0], "ranges": {"0": [0, 1]}}, 400, '"ranges"'),
    (ORDER, {"indexes": [0], "ranges": [[0, 1], [0, 1]]}, 400, '"ranges"'),
    (ORDER, {"indexes": [0], "ranges": [[0]]}, 400, "ranges[0]"),
    (ORDER, {"indexes": [0], "ranges": [[0, "10"]]}, 400, "ranges[0]"),
    (ORDER, {"indexes": [0], "ranges": [[False, 10]]}, 400, "ranges[0]"),
    (ORDER, {"indexes": [0], "ranges": [[0, 1.5]]}, 400, "ranges[0]"),
    (ORDER, {"indexes": [0], "ranges": [[0, 0]]}, 400, "ranges[0]"),
    (ORDER, {"indexes": [0], "ranges": [[10**9, 1]]}, 400, "ranges[0]"),
    (ORDER, {"indexes": [0], "ranges": [[-10**15, 10**15 + 10]]}, 400, "ranges[0]"),
    (ORDER, {"snapshot": 5}, 400, '"snapshot"'),
    (ORDER, {"snapshot": ["latest"]}, 400, '"snapshot"'),
    (ORDER, {"snapshot": "../../../x"}, 400, "snapshot id"),
    (ORDER, {"prefix": ["class0"]}, 400, '"prefix"'),
    (ORDER, {"prefix": 3}, 400, '"prefix"'),
    (EPOCH, {"epoch": "x"}, 400, '"epoch"'),
    (EPOCH, {"epoch": [1]}, 400, '"epoch"'),
    (EPOCH, {"epoch": 1.0}, 400, '"epoch"'),
    (WARM, {"pin": "yes"}, 400, '"pin"'),
    (WARM, {"pin": 1}, 400, '"pin"'),
    (WARM, {"paths": "class0"}, 400, '"paths"'),
    (WARM, {"indexes": {"0": 1}}, 400, '"indexes"'),
    (RESIDENCY, {"paths": [1, 2]}, 400, '"paths"'),
    (RESIDENCY, {"prefix": {"a": 1}}, 400, '"prefix"'),
    (RESIDENCY, {"snapshot": 12}, 400, '"snapshot"'),
    (PURGE, {"dataset": 5}, 400, "dataset name"),
    (PURGE, {"dataset": ["ds"]}, 400, "dataset name"),
    (PURGE, {"dataset": "ds\n"}, 400, "dataset name"),
    (PURGE, {"dataset": "ds", "keep": "latest"}, 400, '"keep"'),
    (PURGE, {"dataset": "ds", "keep": [1]}, 400, '"keep"'),
    (PURGE, {"dataset": "ds", "keep": []}, 400, '"keep"'),
    (PURGE, {"dataset": "ds", "keep": ["../../x"]}, 400, "snapshot id"),
    (LOCATE, {"blocks": "x"}, 400, "blocks"),
    (LOCATE, {"blocks": [[V, "0"]]}, 400, "block"),
    (LOCATE, {"blocks": [[V, 2**70]]}, 400, "block"),
    (LOCATE, {"blocks": [[V, 0]], "fetch": "yes"}, 400, '"fetch"'),
    (LOCATE, {"blocks": [[V, 0]], "damaged": 1}, 400, '"damaged"'),
    (LOCATE, {"blocks": [[V, 0]], "since": -1}, 400, '"since"'),
    (LOCATE, {"blocks": [[V, 0]], "since": "0"}, 400, '"since"'),
    (LOCATE, {"blocks": [[V, 0]], "read": [0, 10]}, 400, '"read"'),
    (LOCATE, {"blocks": [[V, 0]], "read": {"start": "0", "end": 10}}, 400, '"read.start"'),
    (LOCATE, {"blocks": [[V, 0]], "read": {"start": 9, "end": 1}}, 400, "read.start"),
    (LOCATE, {"blocks": [[V, 0]], "read": {"start": 0, "end": 1, "size": "1"}}, 400,
     '"read.size"'),
    (LOCATE, {"blocks": [[V, 0]], "read": {"start": 0, "end": 1, "path": 5}}, 400,
     '"read.path"'),
    (LOCATE, {"blocks": [[V, 0]], "read": {"start": 0, "end": 1, "reader": {}}}, 400,
     '"read.reader"'),
    (LOCATE, {"blocks": [[V, 0]], "read": {"start": 0, "end": 2**62, "size": 2**62}}, 400,
     "spans"),
    (READS, {"reads": "x"}, 400, '"reads"'),
    (READS, {"reads": [{"a": 1}]}, 400, '"reads"'),
    (READS, {"reads": [[V, 0, 10]]}, 400, "reads[0]"),
    (READS, {"reads": [[V, 0, 10, [1]]]}, 400, '"reads[0]"'),
    (READS, {"reads": [[V, "0", 10, {}]]}, 400, '"reads[0].start"'),
    (READS, {"reads": [[V, 0, 10, {"size": True}]]}, 400, '"reads[0].size"'),
    (READS, {"reads": [[V, 0, 2**62, {"path": "x", "size": 2**62}]]}, 400, "spans"),
    (READS, {"reads": [[V, 0, 2**39, {}]] * 3}, 400, "spans"),
    (READS, {"reads": [], "bytes": -1}, 400, '"bytes"'),
    (READS, {"reads": [], "bytes": "1"}, 400, '"bytes"'),
    (READS, {"reads": [], "by": 5}, 400, '"by"'),
    (READS, {"reads": [], "since": True}, 400, '"since"'),
    (COUNTS, {"served_bytes": "1"}, 400, '"served_bytes"'),
    (COUNTS, {"served_bytes": True}, 400, '"served_bytes"'),
    (COUNTS, {"served_bytes": -5}, 400, '"served_bytes"'),
    (COUNTS, {"served_bytes": 1.5}, 400, '"served_bytes"'),
    (COUNTS, {"hits": [1]}, 400, '"hits"'),
]
# Bodies that are not JSON objects at all, to every route that reads one.
NOT_JSON = [b"{not json", b"[" * 100_000, b'{"epoch": ' + b"1" * 5000 + b"}", b"\xff\xfe{}",
            gzip.compress(b'{"a": 1')[:-4]]

CORRUPT: list[tuple[bytes, dict[str, str], int]] = [
    (b"not gzip at all", {"Content-Encoding": "gzip"}, 400),
    (b"x" * 100, {"Content-Length": str(65 << 20)}, 413),
]


def error_of(r: urllib3.BaseHTTPResponse) -> dict:
    doc = json.loads(r.data)
    assert set(doc) == {"error"} and doc["error"]["code"] and doc["error"]["message"], doc
    return doc["error"]


def assert_spoke_answers(base: str, dataset: Path) -> None:
    assert http.request("GET", f"{base}/v1/status").status == 200
    r = http.request("POST", f"{base}{RESIDENCY}", body=json.dumps({"prefix": "class1"}))
    assert r.status == 200 and json.loads(r.data)["files"] == 5
    p = dataset / "class1" / "img0001.jpg"
    r = http.request("GET", f"{base}/ds/class1/img0001.jpg")
    assert r.status == 200 and r.data == p.read_bytes()


def bad_body_failures(base: str, routes: set[str], corrupt: bool = True
                      ) -> list[tuple[object, ...]]:
    """Each bad body of BAD_BODIES and NOT_JSON (and CORRUPT) to ``routes``: what did not
    answer as it should (status, a JSON error naming the field, within seconds)."""
    failures: list[tuple[object, ...]] = []
    for route, body, status, names in BAD_BODIES:
        if route not in routes:
            continue
        t = time.monotonic()
        r = http.request("POST", f"{base}{route}", body=json.dumps(body), timeout=30)
        took = time.monotonic() - t
        msg = error_of(r)["message"] if 400 <= r.status < 500 else r.data[:200]
        if r.status != status or names not in msg or took > 5:
            failures.append((route, body, r.status, msg, round(took, 2)))
    for route in routes:
        for raw in NOT_JSON:
            r = http.request("POST", f"{base}{route}", body=raw, timeout=30)
            if r.status != 400 or "not" not in error_of(r)["message"]:
                failures.append((route, raw[:40], r.status, r.data[:200]))
        # Bodies aiohttp cannot inflate, or that say they are larger than any body may be
        # (the server hangs up after these: each on a connection of its own).
        for raw, headers, status in CORRUPT if corrupt else []:
            r = http.request("POST", f"{base}{route}", body=raw, timeout=30,
                             headers={**headers, "Connection": "close"})
            if r.status != status or not error_of(r)["message"]:
                failures.append((route, raw[:40], headers, r.status, r.data[:200]))
    return failures


def test_wrong_typed_bodies_are_4xx_naming_the_field(spoke_server, hub_server, dataset: Path,
                                                     tmp_path: Path) -> None:
    routes = {ORDER, EPOCH, WARM, RESIDENCY, LOCATE, READS, PURGE, COUNTS}
    # One worker: every request reaches these routes' own checks.
    with spoke(hub_server.url, tmp_path / "cache1", "1GiB", "--workers", "1") as s:
        failures = bad_body_failures(s.url, routes)
        assert not failures, "\n".join(map(str, failures))
        assert_spoke_answers(s.url, dataset)
    # The usual spoke: a replica worker passes these bodies on to the primary as they are
    # (all but the counts, which only replica workers send, to the primary directly; and
    # CORRUPT: a replica reads a body whole before it passes it on).
    failures = bad_body_failures(spoke_server.url, routes - {COUNTS}, corrupt=False)
    assert not failures, "\n".join(map(str, failures))
    assert_spoke_answers(spoke_server.url, dataset)


def status_of(base: str) -> dict:
    return json.loads(http.request("GET", f"{base}/v1/status").data)


def test_a_bad_entry_leaves_no_order(spoke_server, dataset: Path) -> None:
    base = spoke_server.url
    shards = ["shards/shard-000.tar", "shards/shard-001.tar"]
    good = [[0, 1 << 20], [1 << 20, 1 << 20]]
    for bad in ([0, "x"], [-1, 10], [0, 0], [10**12, 1], [0, 1.0], None):
        r = http.request("POST", f"{base}{ORDER}", body=json.dumps(
            {"epoch": 0, "paths": [*shards, shards[0]], "ranges": [*good, bad]}))
        assert r.status == 400 and "ranges" in error_of(r)["message"], r.data
    prefetch = status_of(base)["prefetch"]
    assert prefetch.get("orders", 0) == 0 and prefetch["pinned_bytes"] == 0, prefetch
    # The job's reads work (a half-built order made them fail).
    for rel in shards:
        r = http.request("GET", f"{base}/ds/{rel}", headers={"X-Spokefs-Job": "j"})
        assert r.status == 200 and r.data == (dataset / rel).read_bytes()
    # The same order without the bad entry is taken: the status above could see one.
    r = http.request("POST", f"{base}{ORDER}", body=json.dumps(
        {"epoch": 1, "paths": shards, "ranges": good}))
    assert r.status == 200, r.data
    assert status_of(base)["prefetch"]["orders"] == 1


def test_huge_ranges_are_clipped_quickly(spoke_server, dataset: Path) -> None:
    base = spoke_server.url
    shards = sorted(str(p.relative_to(dataset)) for p in (dataset / "shards").iterdir())
    r = http.request("POST", f"{base}{ORDER}", timeout=10, body=json.dumps(
        {"epoch": 0, "paths": shards, "ranges": [[1, 10**15]] * len(shards)}))
    assert r.status == 200, r.data
    pinned = status_of(base)["prefetch"]["pinned_bytes"]
    assert 0 < pinned <= sum((dataset / rel).stat().st_size for rel in shards)
    for rel in shards:
        r = http.request("GET", f"{base}/ds/{rel}", headers={"X-Spokefs-Job": "j"})
        assert r.status == 200 and r.data == (dataset / rel).read_bytes()
    t = time.monotonic()  # many of them: work by the blocks the files have
    r = http.request("POST", f"{base}/v1/datasets/ds/jobs/k/order", timeout=10, body=json.dumps(
        {"epoch": 0, "paths": shards * 5000, "ranges": [[1, 2**80]] * (len(shards) * 5000)}))
    assert r.status == 200, r.data
    assert time.monotonic() - t < 5
    # More entries than an order may have: refused at once, nothing built.
    body = gzip.compress(json.dumps({"indexes": [0] * 4_000_001}).encode())
    r = http.request("POST", f"{base}/v1/datasets/ds/jobs/big/order", body=body,
                     headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status == 413 and error_of(r)["code"] == "too_large", r.data


def _gzip_bomb(inflated_gib: int) -> bytes:
    """gzip members of 256 MiB of zeros each (~256 KiB apiece), after a JSON start."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    member = c.compress(b'{"prefix": "') + b"".join(c.compress(zeros) for _ in range(256))
    return (member + c.flush()) * (4 * inflated_gib)


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_gzip_bomb_is_413_within_bounded_memory(hub_server, dataset: Path,
                                                tmp_path: Path) -> None:
    # One worker: the process measured is the one that reads the body.
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--workers", "1") as s:
        assert_spoke_answers(s.url, dataset)
        assert s.proc is not None
        pid = s.proc.pid
        rss = _vm(pid, "VmRSS")
        # 10 MiB that inflate to 10 GiB, sent as gzip'd JSON without Content-Encoding; and
        # 1 GiB's worth with it (aiohttp inflates that one; the rest of a body refused is
        # read and dropped, inflated too, for up to 10 s: a smaller bomb keeps this short).
        for bomb, headers in ((_gzip_bomb(10), {}), (_gzip_bomb(1), {"Content-Encoding": "gzip"})):
            t = time.monotonic()
            r = http.request("POST", f"{s.url}{RESIDENCY}", body=bomb, headers=headers,
                             timeout=60)
            assert r.status == 413, r.data[:200]
            err = error_of(r)
            assert err["code"] == "too_large" and "64 MiB" in err["message"]
            assert time.monotonic() - t < 15
            assert_spoke_answers(s.url, dataset)
        grew = max(_vm(pid, "VmHWM"), _vm(pid, "VmRSS")) - rss  # the peak, not just now
        assert grew < 200 << 20, f"the spoke grew by {grew >> 20} MiB"


def test_purge_named_files_and_folders_then_reads_refetch(hub_server, dataset: Path,
                                                         tmp_path: Path) -> None:
    from servers import spoke

    def metric(base: str, name: str) -> float:
        text = urllib3.request("GET", f"{base}/metrics").data.decode()
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                   if x.startswith(name) and not x.startswith("#"))

    def resident(base: str, doc: dict) -> int:
        r = urllib3.request("POST", f"{base}/v1/datasets/ds/residency", body=json.dumps(doc))
        return json.loads(r.data)["resident_bytes"]

    with spoke(hub_server.url, tmp_path / "pcache", "256MiB", "--no-prefetch") as s:
        for p in sorted(dataset.rglob("*.jpg")):
            n = p.relative_to(dataset).as_posix()
            assert urllib3.request("GET", f"{s.url}/ds/{n}").status == 200
        assert resident(s.url, {"prefix": "class1/"}) > 0
        one = "class2/img0002.jpg"
        run = subprocess.run([sys.executable, "-m", "spokefs.cli", "purge", f"{s.url}/ds",
                              "class1", one], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "freed" in run.stdout, run.stderr
        assert resident(s.url, {"prefix": "class1/"}) == 0  # the folder's files
        assert resident(s.url, {"paths": [one]}) == 0       # the named file
        assert resident(s.url, {"prefix": "class2/"}) > 0   # its neighbours stay
        before = metric(s.url, "spokefs_upstream_bytes_total")
        assert urllib3.request("GET", f"{s.url}/ds/{one}").data == (dataset / one).read_bytes()
        assert metric(s.url, "spokefs_upstream_bytes_total") > before  # fetched again
        bad = urllib3.request("POST", f"{s.url}/v1/purge",
                              body=json.dumps({"dataset": "ds", "paths": ["nope/x"]}))
        assert bad.status == 400 and "neither a file nor a folder" in bad.data.decode()


def test_inventory_lists_what_the_spoke_holds(hub_server, dataset: Path, tmp_path: Path
                                              ) -> None:
    from servers import spoke
    from spokefs.cache.inspect import blocks_on_disk

    with spoke(hub_server.url, tmp_path / "icache", "256MiB", "--no-prefetch") as s:
        names = ["class0/img0000.jpg", "class1/img0001.jpg"]
        for n in names:
            assert urllib3.request("GET", f"{s.url}/ds/{n}").status == 200
        end = time.monotonic() + 10  # use times come from the index, committed in batches
        while len(blocks_on_disk(tmp_path / "icache")) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        run = subprocess.run([sys.executable, "-m", "spokefs.cli", "inventory", s.url,
                              "--json"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        (d,) = json.loads(run.stdout)["datasets"]
        size = sum((dataset / n).stat().st_size for n in names)
        assert d["dataset"] == "ds" and (d["blocks"], d["bytes"]) == (2, size), d
        assert d["least_recent_use"] <= d["most_recent_use"] <= time.time()
        (snap,) = d["snapshots"]
        empty = sum(1 for p in dataset.rglob("*") if p.is_file() and not p.stat().st_size)
        assert snap["resident_files"] == 2 + empty and snap["resident_bytes"] == size
        run = subprocess.run([sys.executable, "-m", "spokefs.cli", "inventory", s.url],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and f"{2 + empty}/" in run.stdout and "ds" in run.stdout
        # --tier on a spoke alone: its own inventory, under its URL
        run = subprocess.run([sys.executable, "-m", "spokefs.cli", "inventory", "--tier", s.url],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and run.stdout.startswith(f"{s.url}\n"), run.stdout
        assert f"{2 + empty}/" in run.stdout


def test_a_principal_past_its_job_rate_gets_429_before_its_body_is_read(
        hub_server, dataset: Path, tmp_path: Path) -> None:
    """A job's requests (orders, epochs, step reports) past the principal's burst are refused
    with 429 and Retry-After (``wire.ratelimit``), on every worker (a replica refuses before
    it forwards); another principal is not held back with it; and a refusal neither parses
    the body nor reaches the planner."""
    tokens = tmp_path / "spoke.tokens"
    tokens.write_text("a read:ds " + "a" * 32 + "\nb read:ds " + "b" * 32 + "\n")
    burst = 6
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--workers", "2", "--auth",
               str(tokens), env={"SPOKEFS_JOB_BURST": str(burst), "SPOKEFS_JOB_RATE": "0.05"}
               ) as s:
        def post(token: str, body: bytes = b'{"epoch": 0}') -> urllib3.BaseHTTPResponse:
            return urllib3.request(  # a connection each: they land on either worker
                "POST", f"{s.url}/v1/datasets/ds/jobs/{token[0]}/epoch", body=body,
                retries=False, headers={"Authorization": f"Bearer {token}",
                                        "Content-Type": "application/json",
                                        "Connection": "close"})

        a, b = "a" * 32, "b" * 32
        statuses = [post(a).status for _ in range(4 * burst)]
        # Each worker admits a burst; none admits more (the rate adds one per 20 s).
        assert burst <= statuses.count(200) <= 2 * burst, statuses
        assert set(statuses) == {200, 429}, statuses
        refused = post(a, b"not json at all")  # refused before the body is looked at
        assert refused.status == 429
        err = json.loads(refused.data)["error"]
        assert err["code"] == "rate_limited" and "try again in" in err["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        assert post(b).status == 200  # another token has its own bucket
        assert post(b, b"not json at all").status == 400  # admitted, then its body judged
