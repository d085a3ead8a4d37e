"""A replica worker's view of which snapshots are in use (in process, no primary running:
its reports fail and are dropped, as they are while a primary restarts)."""

from __future__ import annotations

from pathlib import Path

from spokefs.spoke.replica import ReplicaBackend


async def test_a_snapshot_read_stays_in_use_after_the_report(tmp_path: Path) -> None:
    # A read resolves its snapshot, then checks the file's version against the snapshots in
    # use. The report to the primary between the two once emptied that set, so a file of a
    # snapshot made a moment ago was answered 404 (seen under load in test_s3_origin).
    b = ReplicaBackend(tmp_path / "no-primary.sock", deadline=0.2)
    try:
        b.snapshots_used("d", ["s-old"])
        b.snapshots_used("d", ["s-new"])
        b.snapshots_used("other", ["s-x"])
        await b._report()  # the primary is not there: the report is lost, nothing else
        assert list(b.versions._in_use("d"))[:2] == ["s-new", "s-old"]  # newest first
        assert "s-x" not in b.versions._in_use("d")
        for i in range(ReplicaBackend.RECENT_SNAPSHOTS + 5):  # bounded
            b.snapshots_used("d", [f"s{i}"])
        assert len(list(b.versions._in_use("d"))) == ReplicaBackend.RECENT_SNAPSHOTS
    finally:
        await b.primary.close()
