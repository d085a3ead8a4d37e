"""Tokens at every hop: clients -> spoke -> hub, scopes, reloads (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

import spokefs
from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.errors import ConfigError
from spokefs.mount.process import MountError, MountProcess, fuse_unusable, unmount
from spokefs.wire.auth import parse_tokens

ADMIN = "admin-" + "a" * 32
READER = "reader-" + "r" * 32
READER2 = "reader2-" + "q" * 32
OTHER = "other-" + "o" * 32      # may read another dataset only
SPOKE = "spoke-" + "s" * 32      # the spoke's own token at the hub
STRANGER = "stranger-" + "x" * 32

http = urllib3.PoolManager(retries=False)


def req(method: str, url: str, token: str | None = None, doc: dict | None = None
        ) -> urllib3.BaseHTTPResponse:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = None
    if doc is not None:
        body, headers["Content-Type"] = json.dumps(doc).encode(), "application/json"
    return http.request(method, url, headers=headers, body=body)


def message(r: urllib3.BaseHTTPResponse) -> str:
    return json.loads(r.data)["error"]["message"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Path, ServerProcess, ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("auth")
    ds = make_dataset(root / "ds", n_small=8, big_sizes=(5_000_000,))
    (root / "hub.tokens").write_text(f"# the hub's tokens\nspoke read {SPOKE}\n"
                                     f"admin admin {ADMIN}\n")
    (root / "spoke.tokens").write_text(f"admin admin {ADMIN}\nreader read {READER}\n"
                                       f"reader2 read:ds {READER2}\n"
                                       f"other read:elsewhere {OTHER}\n")
    (root / "spoke.token").write_text(SPOKE + "\n")
    with hub(ds, root / "hubstate", "--auth", str(root / "hub.tokens")) as h, \
            spoke(h.url, root / "cache", "256MiB", "--auth", str(root / "spoke.tokens"),
                  "--upstream-token-file", str(root / "spoke.token")) as s:
        yield ds, h, s, root


def test_token_files_are_checked_and_never_echo_a_secret() -> None:
    with pytest.raises(ConfigError, match="line 2: expected 'NAME SCOPE TOKEN'"):
        parse_tokens(f"a read {READER}\nb read\n")
    with pytest.raises(ConfigError, match="scope 'write'") as info:
        parse_tokens(f"a write {READER}\n")
    assert READER not in str(info.value)
    with pytest.raises(ConfigError, match="shorter than 16"):
        parse_tokens("a read short\n")
    with pytest.raises(ConfigError, match="second token named"):
        parse_tokens(f"a read {READER}\na admin {ADMIN}\n")
    tokens = parse_tokens(f"r read:x,y {READER}\n")
    (t,) = tokens.values()
    assert t.may_read("x") and not t.may_read("z") and not t.admin


def test_every_hop_needs_a_token(stack) -> None:
    ds, h, s, _ = stack
    name = "class0/img0000.jpg"
    for base in (h.url, s.url):
        r = req("GET", f"{base}/ds/{name}")
        assert r.status == 401 and "SPOKEFS_TOKEN" in message(r)
        r = req("GET", f"{base}/ds/{name}", STRANGER)
        assert r.status == 401 and STRANGER not in r.data.decode()
    # The spoke fetches with its own token (the hub does not know the reader's).
    r = req("GET", f"{s.url}/ds/{name}", READER)
    assert r.status == 200 and r.data == (ds / name).read_bytes()


def test_scopes(stack) -> None:
    _, h, s, _ = stack
    r = req("GET", f"{s.url}/ds/class0/img0000.jpg", OTHER)
    assert r.status == 403 and "may not read dataset 'ds'" in message(r)
    r = req("POST", f"{s.url}/v1/purge", READER, {})
    assert r.status == 403 and "admin" in message(r)
    r = req("POST", f"{s.url}/v1/datasets/ds/warm", READER, {"prefix": "class1/"})
    assert r.status == 403
    assert req("POST", f"{s.url}/v1/datasets/ds/warm", ADMIN, {"prefix": "class1/"}).status \
        == 202
    r = req("POST", f"{h.url}/v1/datasets/ds/snapshots", SPOKE, {})
    assert r.status == 403  # the spoke's token may read the hub, not snapshot it
    assert req("GET", f"{s.url}/v1/status", OTHER).status == 200  # names no dataset


def test_a_job_belongs_to_the_token_that_announced_it(stack) -> None:
    _, _, s, _ = stack
    order = {"epoch": 0, "paths": ["class0/img0000.jpg", "class1/img0001.jpg"]}
    assert req("POST", f"{s.url}/v1/datasets/ds/jobs/mine/order", READER, order).status == 200
    r = req("POST", f"{s.url}/v1/datasets/ds/jobs/mine/epoch", READER2, {"epoch": 1})
    assert r.status == 403 and "announced with token 'reader'" in message(r)
    assert req("DELETE", f"{s.url}/v1/datasets/ds/jobs/mine", READER2).status == 403
    assert req("POST", f"{s.url}/v1/datasets/ds/jobs/mine/epoch", READER, {"epoch": 1}
               ).status == 200
    r = req("DELETE", f"{s.url}/v1/datasets/ds/jobs/mine", ADMIN)
    assert r.status in (200, 204)  # an admin may end anyone's job


def test_clients_take_the_token_from_the_environment(stack, monkeypatch, tmp_path: Path
                                                     ) -> None:
    ds, _, s, _ = stack
    name = "class2/img0002.jpg"
    monkeypatch.delenv("SPOKEFS_TOKEN", raising=False)
    with pytest.raises(spokefs.Unauthorized):
        spokefs.open(f"{s.url}/ds/{name}").read()
    monkeypatch.setenv("SPOKEFS_TOKEN", READER)
    with spokefs.open(f"{s.url}/ds/{name}") as f:
        assert f.read() == (ds / name).read_bytes()
    # The CLI: --token-file, never the token on the command line.
    monkeypatch.delenv("SPOKEFS_TOKEN")
    (tmp_path / "t").write_text(ADMIN + "\n")
    run = subprocess.run([sys.executable, "-m", "spokefs.cli", "--token-file",
                          str(tmp_path / "t"), "status", s.url], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "spokefs.cli", "status", s.url],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "SPOKEFS_TOKEN"})
    assert run.returncode != 0 and "token" in run.stderr


def test_the_token_file_is_read_again_when_it_changes(stack) -> None:
    _, _, s, root = stack
    late = "late-" + "l" * 32
    url = f"{s.url}/ds/class3/img0003.jpg"
    assert req("GET", url, late).status == 401
    path = root / "spoke.tokens"
    before = path.read_text()
    path.write_text(before + f"late read {late}\n")
    try:
        end = time.monotonic() + 10
        while req("GET", url, late).status != 200:
            assert time.monotonic() < end, "the new token was never accepted"
            time.sleep(0.2)
    finally:
        path.write_text(before)


def test_no_auth_means_loopback_unless_insecure(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", n_small=1, big_sizes=())
    run = subprocess.run([sys.executable, "-m", "spokefs.cli", "hub", "serve", str(ds),
                          "--state-dir", str(tmp_path / "st"), "--host", "0.0.0.0",
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "without --auth" in run.stderr
    with ServerProcess("hub", "serve", str(ds), "--state-dir", str(tmp_path / "st"),
                       "--host", "0.0.0.0", "--port", "0", "--insecure") as h:
        assert any("--insecure" in line for line in h.lines)


@pytest.mark.skipif(fuse_unusable() is not None, reason=f"no FUSE: {fuse_unusable()}")
def test_a_mount_presents_the_token_of_its_environment(stack, tmp_path: Path) -> None:
    ds, _, s, root = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    name = "class1/img0001.jpg"
    big = "shards/shard-000.tar"  # blocks over HTTP and, on this host, the cache files
    env = {k: v for k, v in os.environ.items() if k != "SPOKEFS_TOKEN"}
    with pytest.raises(MountError, match="token"):
        MountProcess(f"{s.url}/ds", mp, env=env).start(timeout=60)
    unmount(mp)
    # A read token's status names no cache folder: the mount reads over HTTP, and says how
    # to name the folder.
    with MountProcess(f"{s.url}/ds", mp, env={"SPOKEFS_TOKEN": READER}) as m:
        assert (mp / big).read_bytes() == (ds / big).read_bytes()
        assert any("--spoke-cache" in line for line in m.output), "".join(m.output)
    cache = root / "cache"
    assert cache.stat().st_mode & 0o777 == 0o700  # the spoke keeps its folder to itself
    with MountProcess(f"{s.url}/ds", mp, "--spoke-cache", str(cache),
                      env={"SPOKEFS_TOKEN": READER}) as m:
        assert (mp / name).read_bytes() == (ds / name).read_bytes()
        assert (mp / big).read_bytes() == (ds / big).read_bytes()
        assert any("short circuit on" in line for line in m.output), "".join(m.output)
    # A folder others may write is not trusted, whatever it holds.
    cache.chmod(0o770)
    try:
        with MountProcess(f"{s.url}/ds", mp, "--spoke-cache", str(cache),
                          env={"SPOKEFS_TOKEN": READER}) as m:
            assert (mp / big).read_bytes() == (ds / big).read_bytes()
            assert not any("short circuit on" in line for line in m.output)
    finally:
        cache.chmod(0o700)


# -- TLS ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Path, ServerProcess, ServerProcess, Path]]:
    """Hub and spoke over https with certificates of a throwaway authority, tokens on."""
    import trustme

    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(root / "server.pem"))
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    trustme.CA().cert_pem.write_to_path(str(root / "other-ca.pem"))
    ds = make_dataset(root / "ds", n_small=4, big_sizes=(5_000_000,))
    (root / "tokens").write_text(f"spoke read {SPOKE}\nreader read {READER}\n")
    (root / "spoke.token").write_text(SPOKE)
    tls = ["--tls-cert", str(root / "server.pem"), "--tls-key", str(root / "server.pem")]
    env = {"SPOKEFS_CA_BUNDLE": str(root / "ca.pem")}  # the spoke trusts the hub's authority
    with ServerProcess("hub", "serve", str(ds), "--port", "0", "--state-dir",
                       str(root / "hubstate"), "--auth", str(root / "tokens"), *tls) as h, \
            ServerProcess("spoke", "serve", "--upstream", h.url, "--cache-dir",
                          str(root / "cache"), "--cache-size", "256MiB", "--port", "0",
                          "--no-fsync", "--auth", str(root / "tokens"),
                          "--upstream-token-file", str(root / "spoke.token"), *tls,
                          env=env) as s:
        yield ds, h, s, root


def test_tls_end_to_end_and_an_untrusted_certificate_is_a_clear_error(
        tls_stack, monkeypatch) -> None:
    ds, h, s, root = tls_stack
    assert h.url.startswith("https://") and s.url.startswith("https://")
    name = "shards/shard-000.tar"
    monkeypatch.setenv("SPOKEFS_TOKEN", READER)
    monkeypatch.setenv("SPOKEFS_CA_BUNDLE", str(root / "ca.pem"))
    import spokefs.wire.tls as tls

    tls._client_context.cache_clear()
    with spokefs.open(f"{s.url}/ds/{name}") as f:  # client -> spoke -> hub, all https
        assert f.read() == (ds / name).read_bytes()
    run = subprocess.run([sys.executable, "-m", "spokefs.cli", "--ca-bundle",
                          str(root / "other-ca.pem"), "cat", f"{s.url}/ds/{name}"],
                         capture_output=True, timeout=60)
    assert run.returncode == 2
    err = run.stderr.decode()
    assert "certificate" in err and "not trusted" in err and "--ca-bundle" in err, err
    plain = subprocess.run([sys.executable, "-m", "spokefs.cli", "status",
                            s.url.replace("https://", "http://")], capture_output=True,
                           timeout=60)
    assert plain.returncode != 0  # no plain http on a TLS port


@pytest.mark.skipif(fuse_unusable() is not None, reason=f"no FUSE: {fuse_unusable()}")
def test_a_mount_over_tls(tls_stack, tmp_path: Path) -> None:
    ds, _, s, root = tls_stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    with MountProcess(f"{s.url}/ds", mp, env={"SPOKEFS_TOKEN": READER,
                                              "SPOKEFS_CA_BUNDLE": str(root / "ca.pem")}):
        for name in ("class0/img0000.jpg", "shards/shard-000.tar"):
            assert (mp / name).read_bytes() == (ds / name).read_bytes()


def test_concurrent_ranges_over_tls_never_mix_bytes(tls_stack) -> None:
    """Answers over TLS cannot use sendfile(2). asyncio's fallback seeks the file object and
    reads from its position, and a spoke's segment file is one object shared by every answer:
    two ranges of one segment sent at once over https read each other's bytes. Ranges larger
    than the spoke's small-read size, of two blocks, many times at once, each compared."""
    ds, _, s, root = tls_stack
    name = "shards/shard-000.tar"
    whole = (ds / name).read_bytes()
    pool = urllib3.PoolManager(ca_certs=str(root / "ca.pem"), maxsize=16, retries=False)
    url = f"{s.url}/ds/{name}"
    auth = {"Authorization": f"Bearer {READER}"}
    assert pool.request("GET", url, headers=auth).data == whole  # both blocks resident
    bs = 4 * 1024 * 1024
    ranges = [(0, bs), (bs, len(whole)), (300_000, 3_900_000), (bs + 1000, len(whole) - 7)]

    def one(i: int) -> bool:
        lo, hi = ranges[i % len(ranges)]
        r = pool.request("GET", url, headers={**auth, "Range": f"bytes={lo}-{hi - 1}"})
        return r.status == 206 and r.data == whole[lo:hi]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(12) as ex:
        results = list(ex.map(one, range(240)))
    assert all(results), f"{results.count(False)} of {len(results)} ranges came back wrong"
