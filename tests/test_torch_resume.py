"""The announced order resumes with the model: a sampler state saved mid-epoch, loaded in a
new sampler (a restarted job on a fresh node), gives the rest of that epoch and then the
epochs the first run would have drawn, and tells the spoke the rest before it is read."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from spokefs.client.control import SpokeControl
from test_torch_hints import wait_for

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler, RandomSampler  # noqa: E402

from spokefs.torch import AnnouncingSampler  # noqa: E402

NOWHERE = "http://127.0.0.1:9/ds"  # the hints fail fast; the order is what is tested here
PATHS = [f"f{i:03d}" for i in range(40)]


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)  # as a checkpoint holds it
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def make(kind: str, seed: int) -> AnnouncingSampler:
    data = range(len(PATHS))
    if kind == "generator":
        inner = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    elif kind == "global":
        inner = RandomSampler(data)
    else:
        inner = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=seed)
    return AnnouncingSampler(inner, PATHS, NOWHERE, deadline=0.2)


@pytest.mark.parametrize("kind", ["generator", "global", "distributed"])
def test_resumed_sampler_gives_the_rest_then_the_same_epochs(kind: str) -> None:
    torch.manual_seed(5)
    first = make(kind, seed=11)
    if kind == "distributed":
        first.set_epoch(0)
    it = iter(first)
    taken = [next(it) for _ in range(9)]  # the loader ran ahead of training ...
    state = roundtrip(first.state_dict(consumed=7))  # ... which took 7
    whole0 = taken + list(it)
    if kind == "distributed":
        first.set_epoch(1)
    whole1 = list(iter(first))

    torch.manual_seed(999)  # a new process: other global state, another seed in its code
    again = make(kind, seed=11 if kind == "distributed" else 12)
    again.load_state_dict(state)
    assert len(again) == len(whole0) - 7
    assert list(iter(again)) == whole0[7:]
    if kind == "distributed":
        again.set_epoch(1)
    assert list(iter(again)) == whole1


def test_a_state_at_an_epochs_end_resumes_at_the_next_epoch() -> None:
    s = make("generator", seed=3)
    assert s.state_dict() == {"version": 1, "epoch": 0, "position": 0, "draw": None}
    list(iter(s))
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 0
    with pytest.raises(ValueError, match="not a spokefs"):
        s.load_state_dict({"epoch": 1})


def test_resumed_order_is_announced_from_its_position(spoke_server, dataset: Path) -> None:
    base = f"{spoke_server.url}/ds"
    paths = sorted(p.relative_to(dataset).as_posix() for p in dataset.rglob("*.jpg"))
    first = AnnouncingSampler(RandomSampler(range(len(paths)),
                                            generator=torch.Generator().manual_seed(1)),
                              paths, "http://127.0.0.1:9/ds", job="r1", deadline=0.2)
    it = iter(first)  # the first run: its spoke is gone (nothing announced here)
    head = [next(it) for _ in range(8)]  # it had given 8 when the checkpoint was taken
    state = roundtrip(first.state_dict())
    order = head + list(it)

    again = AnnouncingSampler(RandomSampler(range(len(paths)),
                                            generator=torch.Generator()),
                              paths, base, job="r1")
    again.load_state_dict(state)
    rest = list(iter(again))
    again.wait_announced(10)
    assert rest == order[8:]
    ctl = SpokeControl(base)
    # Nothing read yet: the rest becomes resident ahead; what came before it is not fetched.
    assert wait_for(lambda: ctl.residency(paths=[paths[i] for i in rest])["fraction"] == 1.0)
    assert ctl.residency(paths=[paths[i] for i in order[:8]])["fraction"] == 0.0
