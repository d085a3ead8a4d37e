"""The audit log (--audit-log): reads by token name, refusals without secrets, cache
summaries, purges, and the hub's view of a spoke (real processes)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, hub, make_dataset
from spokefs.audit import Audit

ADMIN = "admin-" + "a" * 32
READER = "reader-" + "r" * 32
OTHER = "other-" + "o" * 32      # may read another dataset only
SPOKE = "spoke-" + "s" * 32      # the spoke's own token at the hub
STRANGER = "stranger-" + "x" * 32
SECRETS = (ADMIN, READER, OTHER, SPOKE, STRANGER)

http = urllib3.PoolManager(retries=False)


def get(url: str, token: str | None = None, method: str = "GET", doc: dict | None = None
        ) -> urllib3.BaseHTTPResponse:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = None
    if doc is not None:
        body, headers["Content-Type"] = json.dumps(doc).encode(), "application/json"
    return http.request(method, url, headers=headers, body=body)


def records(pattern: Path) -> list[dict]:
    """Every record of a log and its rotated or per-worker siblings (FILE*)."""
    out = []
    for f in sorted(pattern.parent.glob(pattern.name + "*")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line]
    return out


def wait_for(log: Path, match: Callable[[dict], bool], timeout: float = 20.0) -> list[dict]:
    """The records that match, once there is one (written by a thread: poll, with a limit)."""
    end = time.monotonic() + timeout
    while True:
        found = [r for r in records(log) if match(r)]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Path, ServerProcess, ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("audit")
    ds = make_dataset(root / "ds", n_small=4, big_sizes=(5_000_000,))
    (root / "hub.tokens").write_text(f"spoke read {SPOKE}\nadmin admin {ADMIN}\n")
    (root / "spoke.tokens").write_text(f"admin admin {ADMIN}\nreader read {READER}\n"
                                       f"other read:elsewhere {OTHER}\n")
    (root / "spoke.token").write_text(SPOKE + "\n")
    with hub(ds, root / "hubstate", "--auth", str(root / "hub.tokens"),
             "--audit-log", str(root / "hub.audit")) as h, \
            ServerProcess("spoke", "serve", "--upstream", h.url, "--cache-dir",
                          str(root / "cache"), "--cache-size", "256MiB", "--port", "0",
                          "--no-fsync", "--workers", "2", "--auth", str(root / "spoke.tokens"),
                          "--upstream-token-file", str(root / "spoke.token"),
                          "--audit-log", str(root / "spoke.audit"),
                          env={"SPOKEFS_AUDIT_INTERVAL": "0.5"}) as s:
        yield ds, h, s, root


def test_reads_are_recorded_by_token_name_with_their_bytes(stack) -> None:
    ds, _h, s, root = stack
    names = ["class0/img0000.jpg", "shards/shard-000.tar"]  # gathered, and streamed
    for name in names:
        r = get(f"{s.url}/ds/{name}", READER)
        assert r.status == 200 and r.data == (ds / name).read_bytes()
    for name in names:
        (rec,) = wait_for(root / "spoke.audit",
                          lambda r, n=name: r["event"] == "read" and r.get("path") == n)
        assert rec["token"] == "reader" and rec["dataset"] == "ds"
        assert rec["bytes"] == (ds / name).stat().st_size and rec["status"] == 200
        assert rec["remote"] and rec["version"] and isinstance(rec["ts"], float)
    # Replica worker 1 writes its own reads to its own file (rotation is per process).
    assert (root / "spoke.audit.worker-1").exists()
    # The hub saw the spoke's batch reads, under the spoke's token name.
    hub_reads = wait_for(root / "hub.audit", lambda r: r["event"] == "read")
    assert hub_reads and {r["token"] for r in hub_reads} == {"spoke"}
    assert {r["dataset"] for r in hub_reads} == {"ds"}
    assert sum(r["bytes"] for r in hub_reads) >= sum((ds / n).stat().st_size for n in names)
    # What the spoke took in, summed per dataset within its interval.
    want = sum((ds / n).stat().st_size for n in names)
    assert wait_for(root / "spoke.audit", lambda r: r["event"] == "cached"
                    and r["dataset"] == "ds"
                    and sum(x["bytes"] for x in records(root / "spoke.audit")
                            if x["event"] == "cached") >= want)


def test_refusals_are_recorded_without_a_secret(stack) -> None:
    _ds, h, s, root = stack
    assert get(f"{s.url}/ds/class1/img0001.jpg").status == 401
    assert get(f"{s.url}/ds/class1/img0001.jpg", STRANGER).status == 401
    assert get(f"{s.url}/ds/class1/img0001.jpg", OTHER).status == 403
    assert get(f"{h.url}/ds/class1/img0001.jpg", READER).status == 401  # unknown at the hub
    refused = wait_for(root / "spoke.audit", lambda r: r["event"] == "refused")
    end = time.monotonic() + 20
    while len(refused) < 3 and time.monotonic() < end:
        time.sleep(0.05)
        refused = [r for r in records(root / "spoke.audit") if r["event"] == "refused"]
    assert sorted(r["status"] for r in refused) == [401, 401, 403]
    assert all(r["path"] == "/ds/class1/img0001.jpg" and r["reason"] for r in refused)
    assert {r["token"] for r in refused if r["status"] == 403} == {"other"}
    assert all(r["token"] is None for r in refused if r["status"] == 401)
    assert wait_for(root / "hub.audit", lambda r: r["event"] == "refused"
                    and r["status"] == 401)
    for f in root.glob("*.audit*"):
        text = f.read_text()
        for secret in SECRETS:
            assert secret not in text, f"{f.name} holds a token"


def test_a_purge_is_recorded(stack) -> None:
    _ds, _h, s, root = stack
    assert get(f"{s.url}/ds/class2/img0002.jpg", READER).status == 200
    r = get(f"{s.url}/v1/purge", ADMIN, "POST", {"dataset": "ds"})
    assert r.status == 200, r.data
    freed = json.loads(r.data)["freed_bytes"]
    assert freed > 0
    purged = wait_for(root / "spoke.audit", lambda r: r["event"] == "purged"
                      and r["dataset"] == "ds")
    assert purged and sum(r["bytes"] for r in purged) == freed
    assert all(r["blocks"] > 0 for r in purged)
    # Who ran it, once (whichever worker answered), and a refused one too.
    (who,) = wait_for(root / "spoke.audit", lambda r: r["event"] == "admin"
                      and r["path"] == "/v1/purge" and r["status"] == 200)
    assert who["token"] == "admin" and who["method"] == "POST" and who["remote"]
    assert get(f"{s.url}/v1/datasets/ds/warm", ADMIN, "POST", {"paths": ["nope"]}).status == 400
    (bad,) = wait_for(root / "spoke.audit", lambda r: r["event"] == "admin"
                      and r["path"] == "/v1/datasets/ds/warm")
    assert bad["status"] == 400 and bad["token"] == "admin"


def test_no_file_means_no_log_and_lines_are_json(tmp_path: Path) -> None:
    Audit().write("read", token="x")  # a no-op: nothing to open, nothing raised
    audit = Audit(tmp_path / "a.log", max_bytes=2000, backups=2)
    for i in range(100):
        audit.write("read", token="t", dataset="ds", path=f"f{i}", bytes=i)
    audit.close()
    audit.write("read", token="late")  # after close: dropped, not an error
    files = sorted(tmp_path.glob("a.log*"))
    assert [f.name for f in files] == ["a.log", "a.log.1", "a.log.2"]  # rotated, bounded
    recs = records(tmp_path / "a.log")
    assert all(r["event"] == "read" and r["token"] == "t" for r in recs)
    newest = (tmp_path / "a.log").read_text().splitlines()
    assert json.loads(newest[-1])["path"] == "f99"
