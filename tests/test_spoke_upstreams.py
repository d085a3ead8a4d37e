"""A spoke over several upstreams: each dataset from the first upstream whose patterns match
its name, each upstream with its own token, one cache for all; one upstream down leaves the
others' datasets readable (real hubs and a real spoke on 127.0.0.1)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.errors import ConfigError
from spokefs.spoke.upstreams import Routes, UpstreamSpec, parse_upstream, with_tokens

http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=30))
TOKEN_A, TOKEN_B = "tok-a-" + "a" * 32, "tok-b-" + "b" * 32


# -- the rule (sans-I/O) ---------------------------------------------------------------------
def test_the_first_upstream_whose_patterns_match_serves_the_dataset() -> None:
    r = Routes([parse_upstream("b-*,shared=https://hub-us:8470"),
                parse_upstream("https://hub-eu:8470/"),
                parse_upstream("never=http://third:1")])
    assert [r.url(n) for n in ("b-one", "shared", "imagenet", "never")] == [
        "https://hub-us:8470", "https://hub-us:8470", "https://hub-eu:8470",
        "https://hub-eu:8470"]  # the catch-all comes first for "never": order settles it
    assert r.serves(0, "b-one") and not r.serves(1, "b-one")
    only = Routes([parse_upstream("team-[ab]?=http://h:1")])
    assert only.index("team-a1") == 0 and only.index("team-c1") is None
    assert parse_upstream("http://h:1/?x=y").url == "http://h:1/?x=y"  # "=" in a URL's query


@pytest.mark.parametrize(("flags", "why"), [
    (["=http://h:1"], "no dataset pattern"),
    (["a/b=http://h:1"], "not a dataset name or pattern"),
    (["a=ftp://h"], "not an http"),
    (["http://h:1", "a=http://h:1"], "given twice"),
    (["http://h:1", "s3://bucket/p"], "only upstream"),
])
def test_bad_upstreams_are_refused_naming_why(flags: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        Routes([parse_upstream(f) for f in flags])


def test_one_token_file_is_never_sent_to_several_upstreams() -> None:
    specs = [UpstreamSpec("http://a:1"), UpstreamSpec("http://b:1")]
    with pytest.raises(ConfigError, match="one per upstream"):
        with_tokens(specs, ["only.token"])
    assert [s.token_file for s in with_tokens(specs, ["a", "b"])] == ["a", "b"]
    assert [s.token_file for s in with_tokens(specs, [])] == [None, None]


def test_the_spoke_refuses_to_start_with_one_token_for_two_hubs(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("x" * 32 + "\n")
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "spoke", "serve",
                        "--upstream", "http://127.0.0.1:1", "--upstream", "b=http://127.0.0.1:2",
                        "--upstream-token-file", str(tmp_path / "t"),
                        "--cache-dir", str(tmp_path / "c"), "--cache-size", "1GiB"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "1 --upstream-token-file for 2 --upstream" in r.stderr


# -- two hubs, one spoke ---------------------------------------------------------------------
Stack = tuple[dict[str, Path], ServerProcess, ServerProcess, ServerProcess]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    dirs = {name: make_dataset(tmp_path / name, n_small=4, big_sizes=(1_200_000,), seed=i)
            for i, name in enumerate(("alpha", "b-one", "b-one-at-a", "b-two"))}
    (tmp_path / "a.tokens").write_text(f"spoke read {TOKEN_A}\n")
    (tmp_path / "b.tokens").write_text(f"spoke read {TOKEN_B}\n")
    (tmp_path / "a.token").write_text(TOKEN_A + "\n")
    (tmp_path / "b.token").write_text(TOKEN_B + "\n")
    # Hub A also has a dataset named b-one: the rule sends b-* to hub B, so A's is never read.
    with hub(dirs["alpha"], tmp_path / "sa", "--name", "alpha",
             "--dataset", f"b-one={dirs['b-one-at-a']}",
             "--auth", str(tmp_path / "a.tokens")) as ha, \
            hub(dirs["b-one"], tmp_path / "sb", "--name", "b-one",
                "--dataset", f"b-two={dirs['b-two']}",
                "--auth", str(tmp_path / "b.tokens")) as hb, \
            spoke(f"b-*={hb.url}", tmp_path / "cache", "256MiB", "--upstream", ha.url,
                  "--upstream-token-file", str(tmp_path / "b.token"),
                  "--upstream-token-file", str(tmp_path / "a.token"),
                  "--deadline", "2s") as s:  # default workers: the config crosses to replicas
        yield dirs, ha, hb, s


def get(url: str) -> urllib3.BaseHTTPResponse:
    return http.request("GET", url)


def entry(base: str, ds: str, path: str) -> urllib3.BaseHTTPResponse:
    """The file's bytes (its entry names its version), or the answer that refused them."""
    r = get(f"{base}/v1/datasets/{ds}/snapshots/latest/entries/{path}")
    if r.status != 200:
        return r
    return get(f"{base}/v1/datasets/{ds}/objects/{json.loads(r.data)['version']}")


FILES = ("class0/img0000.jpg", "shards/shard-000.tar")


def test_each_dataset_comes_from_its_upstream_with_that_upstreams_token(stack: Stack) -> None:
    dirs, ha, hb, s = stack
    listed = sorted(d["name"] for d in json.loads(get(f"{s.url}/v1/datasets").data)["datasets"])
    assert listed == ["alpha", "b-one", "b-two"]  # b-one once: hub B's
    for ds, src in (("alpha", "alpha"), ("b-one", "b-one"), ("b-two", "b-two")):
        for path in FILES:
            r = entry(s.url, ds, path)
            assert r.status == 200, (ds, path, r.data[:200])
            assert r.data == (dirs[src] / path).read_bytes(), (ds, path)
    # Neither hub serves a spoke without its own token: each got the one meant for it.
    assert entry(ha.url, "alpha", FILES[0]).status == 401
    assert entry(hb.url, "b-one", FILES[0]).status == 401
    status = json.loads(get(f"{s.url}/v1/status").data)
    assert [(u["url"], u["datasets"]) for u in status["upstreams"]] == [
        (hb.url, ["b-*"]), (ha.url, ["*"])]


def test_a_dataset_no_upstream_matches_is_not_found(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "d", n_small=2, big_sizes=())
    with hub(data, tmp_path / "st", "--name", "other") as h, \
            spoke(f"team-*={h.url}", tmp_path / "c", "64MiB", "--workers", "1") as s:
        assert get(f"{s.url}/v1/datasets").status == 200
        assert json.loads(get(f"{s.url}/v1/datasets").data)["datasets"] == []
        r = entry(s.url, "other", "class0/img0000.jpg")
        assert r.status == 404, r.data
        assert b"served by no upstream" in r.data


def test_one_upstream_down_leaves_the_others_datasets_readable(stack: Stack) -> None:
    dirs, _, hb, s = stack
    before = entry(s.url, "b-one", FILES[0])  # seen (and cached) before hub B goes
    assert before.status == 200
    hb.stop()
    for path in FILES:
        r = entry(s.url, "alpha", path)
        assert r.status == 200 and r.data == (dirs["alpha"] / path).read_bytes()
    # b-one's cached file is still served; its uncached one fails clearly, naming hub B.
    assert entry(s.url, "b-one", FILES[0]).data == (dirs["b-one"] / FILES[0]).read_bytes()
    r = entry(s.url, "b-one", FILES[1])
    assert r.status == 503, r.data[:300]
    # The list still names hub A's datasets and hub B's that this spoke saw before.
    names = {d["name"] for d in json.loads(get(f"{s.url}/v1/datasets").data)["datasets"]}
    assert names == {"alpha", "b-one"}
