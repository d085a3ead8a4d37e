"""Training jobs' step reports: the sans-I/O tracker, the route that feeds it, and the
``spokefs.torch`` reporter posting to a real spoke."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, spoke
from spokefs.errors import BadRequest
from spokefs.spoke.jobsignal import MAX_STEPS, JobSignal, check_steps
from test_spoke import metric

# -- the tracker (no sockets, a clock passed in) ------------------------------------------


def test_totals_and_recent_share() -> None:
    sig = JobSignal(window=10.0)
    sig.report("ds", "a", [(0.1, 0.9), (0.3, 0.7)], now=0.0)
    (job,) = sig.describe(now=0.0)
    assert job["dataset"] == "ds" and job["job"] == "a" and job["steps"] == 2
    assert job["data_wait_share"] == pytest.approx(0.2)
    assert job["utilisation"] == pytest.approx(0.8)
    assert job["data_wait_s"] == pytest.approx(0.4) and job["step_s"] == pytest.approx(1.6)


def test_share_follows_the_recent_window_totals_do_not() -> None:
    sig = JobSignal(window=10.0)
    sig.report("ds", "a", [(1.0, 0.0)] * 5, now=0.0)   # data-bound while warming up
    sig.report("ds", "a", [(0.0, 1.0)] * 5, now=20.0)  # then busy
    (job,) = sig.describe(now=20.0)
    assert job["steps"] == 10 and job["data_wait_s"] == 5.0
    assert job["data_wait_share"] == 0.0 and job["utilisation"] == 1.0
    # A job that paused keeps its last report's share (not "no data").
    (job,) = sig.describe(now=500.0)
    assert job["utilisation"] == 1.0


def test_jobs_are_bounded_least_recent_dropped_first() -> None:
    sig = JobSignal(max_jobs=3)
    for n, name in enumerate("abc"):
        sig.report("ds", name, [(0.0, 1.0)], now=float(n))
    sig.report("ds", "a", [(0.0, 1.0)], now=3.0)  # heard from again: now the most recent
    sig.report("ds", "d", [(0.0, 1.0)], now=4.0)
    assert [j["job"] for j in sig.describe(now=4.0)] == ["a", "c", "d"]
    assert sig.dropped == 1


def test_idle_jobs_are_dropped() -> None:
    sig = JobSignal(idle_drop=60.0)
    sig.report("ds", "old", [(0.0, 1.0)], now=0.0)
    sig.report("ds", "new", [(0.0, 1.0)], now=50.0)
    assert [j["job"] for j in sig.describe(now=100.0)] == ["new"]


def test_no_time_no_share() -> None:
    sig = JobSignal()
    sig.report("ds", "a", [(0.0, 0.0)], now=0.0)
    (job,) = sig.describe(now=0.0)
    assert job["steps"] == 1 and job["data_wait_share"] is None and job["utilisation"] is None


@pytest.mark.parametrize("bad", [
    [1.0, 2.0],              # not a pair
    [[1.0]],                 # one number
    [[1.0, 2.0, 3.0]],
    [["1", 2.0]],            # a string
    [[True, 1.0]],           # a boolean is no number
    [[None, 1.0]],
    [[-0.5, 1.0]],           # negative
    [[1e9, 1.0]],            # past a day
    [[float("nan"), 1.0]],
    [[float("inf"), 1.0]],
])
def test_check_steps_refuses_what_is_not_a_pair_of_times(bad: list[object]) -> None:
    with pytest.raises(BadRequest, match=r"steps\[0\]"):
        check_steps(bad)


def test_check_steps_takes_integers_and_floats() -> None:
    assert check_steps([[0, 1], [0.25, 0.5]]) == [(0.0, 1.0), (0.25, 0.5)]


# -- the route, on a real spoke ----------------------------------------------------------------


@pytest.fixture(scope="module")
def one_spoke(ro_hub: ServerProcess, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServerProcess]:
    """One spoke for the tests below: each reports as a job of its own."""
    with spoke(ro_hub.url, tmp_path_factory.mktemp("jobs-cache"), "64MiB",
               "--workers", "1") as s:
        yield s


def _jobs(base: str) -> dict[str, dict[str, object]]:
    status = json.loads(urllib3.request("GET", f"{base}/v1/status").data)
    return {j["job"]: j for j in status["jobs"]}


def _post(url: str, body: bytes | str) -> urllib3.BaseHTTPResponse:
    data = body.encode() if isinstance(body, str) else body
    return urllib3.request("POST", url, body=data, headers={"Content-Type": "application/json"},
                           retries=False)


def test_route_counts_steps_into_metrics_and_status(spoke_server) -> None:
    # A spoke of its own: the metric sums below are of every job.
    url = f"{spoke_server.url}/v1/datasets/ds/jobs/j1/steps"
    r = _post(url, json.dumps({"steps": [[0.5, 1.5], [0.0, 2.0]]}))
    assert r.status == 200, r.data
    assert json.loads(r.data) == {"dataset": "ds", "job": "j1", "steps": 2}
    assert metric(spoke_server.url, "spokefs_job_steps_total") == 2
    assert metric(spoke_server.url, "spokefs_job_data_wait_seconds_total") == 0.5
    assert metric(spoke_server.url, "spokefs_job_step_seconds_total") == 3.5
    assert metric(spoke_server.url, "spokefs_job_utilisation_ratio") == pytest.approx(0.875)
    status = json.loads(urllib3.request("GET", f"{spoke_server.url}/v1/status").data)
    assert status["jobs"] == [{"dataset": "ds", "job": "j1", "steps": 2,
                               "data_wait_share": 0.125, "utilisation": 0.875,
                               "data_wait_s": 0.5, "step_s": 3.5, "recent_steps": 2}]


@pytest.mark.parametrize(("body", "status", "names"), [
    ("not json", 400, "not JSON"),
    ("[]", 400, "JSON object"),
    ("{}", 400, '"steps"'),
    ('{"steps": 3}', 400, '"steps"'),
    ('{"steps": [[0.1, "x"]]}', 400, "steps[0]"),
    ('{"steps": [[0.1, 0.2], [1]]}', 400, "steps[1]"),
    ('{"steps": [[0.1, -1]]}', 400, "steps[0]"),
    (json.dumps({"steps": [[0.0, 1.0]] * (MAX_STEPS + 1)}), 413, "at most"),
])
def test_route_refuses_malformed_reports(one_spoke, body: str, status: int,
                                         names: str) -> None:
    r = _post(f"{one_spoke.url}/v1/datasets/ds/jobs/bad/steps", body)
    assert r.status == status, r.data
    assert names in json.loads(r.data)["error"]["message"]
    assert "bad" not in _jobs(one_spoke.url)  # nothing half-counted


def test_route_refuses_bad_job_names(one_spoke) -> None:
    r = _post(f"{one_spoke.url}/v1/datasets/ds/jobs/{'x' * 201}/steps",
              '{"steps": [[0, 1]]}')
    assert r.status == 400


# -- the torch-side reporter -------------------------------------------------------------------


def test_reporter_posts_batched_steps_to_the_spoke(one_spoke) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from spokefs.torch import StepReporter

    loader = DataLoader(list(range(12)), batch_size=3)
    with StepReporter(f"{one_spoke.url}/ds", job="train", every=0.2) as steps:
        n = 0
        for _batch in steps.wrap(loader):
            time.sleep(0.01)  # the step's compute
            n += 1
        assert steps.flush(5.0)
        assert steps.sent == n == 4 and steps.dropped == 0
    job = _jobs(one_spoke.url)["train"]
    assert job["steps"] == 4
    assert job["step_s"] >= 4 * 0.01  # type: ignore[operator]
    assert 0.0 <= job["data_wait_share"] < 1.0  # type: ignore[operator]


def test_reporter_with_a_dead_spoke_never_blocks_the_loop(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from spokefs.torch import StepReporter

    steps = StepReporter("http://127.0.0.1:9/ds", job="t", every=0.05, deadline=0.2)
    t0 = time.monotonic()
    for _ in steps.wrap(range(1000)):
        pass
    # A thousand steps: a round trip in the loop would wait out the 0.2 s deadline each time
    # (200 s); the bound leaves a loaded CI machine room.
    assert time.monotonic() - t0 < 5.0
    steps.flush(5.0)
    steps.close()
    assert steps.sent == 0 and steps.dropped == 1000


def test_reports_reach_the_primary_through_any_worker(ro_hub: ServerProcess,
                                                      tmp_path: Path) -> None:
    with spoke(ro_hub.url, tmp_path / "cache", "64MiB", "--workers", "2") as s:
        for _ in range(8):  # a new connection each: they land on either worker
            r = urllib3.request("POST", f"{s.url}/v1/datasets/ds/jobs/w/steps",
                                body=b'{"steps": [[0.25, 0.75]]}', retries=False,
                                headers={"Content-Type": "application/json",
                                         "Connection": "close"})
            assert r.status == 200, r.data
        job = _jobs(s.url)["w"]
        assert job["steps"] == 8 and job["data_wait_share"] == 0.25
