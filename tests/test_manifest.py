from __future__ import annotations

import asyncio
import copy
import gzip
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spokefs.errors import BadUpstream, ManifestError
from spokefs.hub.snapshot import HubState
from spokefs.manifest import Manifest, gunzip, is_version_id, verify
from spokefs.wire.client import UpstreamClient


def _manifest(n: int) -> Manifest:
    paths = sorted(f"d{i % 100:02d}/f{i:07d}.jpg" for i in range(n))
    dirs = ["", *sorted({p.split("/")[0] for p in paths})]
    return Manifest("ds", "5ca1ab1e0000", 0.0, 4 << 20, paths, [100] * n, [0o644] * n,
                    [1] * n, ["ab" * 16] * n, dirs)


def test_roundtrip_lookup_and_listdir() -> None:
    m = _manifest(1000)
    m2 = Manifest.decode(m.encode())
    assert m2 == m
    assert m2.lookup("d03/f0000003.jpg") is not None
    assert m2.lookup("d03") is None and m2.is_dir("d03")
    dirs, files = m2.listdir("")
    assert len(dirs) == 100 and files == []
    _, files = m2.listdir("d03")
    assert len(files) == 10 and all(f.path.startswith("d03/") for f in files)


def test_million_entries_is_practical() -> None:
    m = _manifest(1_000_000)
    t0 = time.perf_counter()
    blob = m.encode()
    m2 = Manifest.decode(blob)
    elapsed = time.perf_counter() - t0
    assert len(m2) == 1_000_000
    assert m2.lookup("d42/f0000042.jpg") is not None
    # A loose bound: this is a correctness test that the format scales, not a benchmark.
    assert elapsed < 30, elapsed
    assert len(blob) < 40 * 2**20


# -- what a manifest from upstream must be ---------------------------------------------------

V = "0123456789abcdef" * 2  # a version id as integrity.version_id makes them


def _doc() -> dict:
    """A valid manifest document (what the hub writes), to break one rule at a time."""
    paths = ["a.txt", "d/b.bin", "d/e/c.jpg", "z"]
    m = Manifest("ds", "", 1_700_000_000.5, 4 << 20, paths, [0, 1, 4 << 20, 5], [0o644] * 4,
                 [1, -5, 0, 2**62], [V, "f" * 32, "0" * 32, V], ["", "d", "d/e", "empty"])
    return Manifest(m.dataset, m.content_id(), m.created, m.block_size, m.paths, m.sizes,
                    m.modes, m.mtimes, m.versions, m.dirs).to_json()


def _with(**changes: object) -> dict:
    doc = copy.deepcopy(_doc())
    for k, v in changes.items():
        if v is _DROP:
            del doc[k]
        else:
            doc[k] = v
    return doc


_DROP = object()


def _col(name: str, i: int, value: object) -> dict:
    doc = copy.deepcopy(_doc())
    doc[name][i] = value
    return doc


BAD_DOCS: dict[str, Callable[[], object]] = {
    # version ids: exactly 32 lower-case hex digits, nothing that could be a path
    "version ../x": lambda: _col("versions", 0, "../x"),
    "version a/b": lambda: _col("versions", 1, "a/b"),
    "version empty": lambda: _col("versions", 2, ""),
    "version 1000 chars": lambda: _col("versions", 3, "A" * 1000),
    "version upper case": lambda: _col("versions", 0, V.upper()),
    "version 31 hex": lambda: _col("versions", 0, V[:31]),
    "version 33 hex": lambda: _col("versions", 0, V + "0"),
    "version 32 not hex": lambda: _col("versions", 0, "g" * 32),
    "version with NUL": lambda: _col("versions", 0, V[:31] + "\x00"),
    "version not a string": lambda: _col("versions", 0, 12),
    "version null": lambda: _col("versions", 0, None),
    # columns of one length
    "one size too few": lambda: _with(sizes=[0, 1, 2]),
    "one mode too many": lambda: _with(modes=[0o644] * 5),
    "mtimes empty": lambda: _with(mtimes=[]),
    "one version too few": lambda: _with(versions=[V] * 3),
    "paths longer": lambda: _with(paths=["a.txt", "d/b.bin", "d/e/c.jpg", "z", "zz"]),
    # integers where integers belong
    "negative size": lambda: _col("sizes", 1, -1),
    "size past int64": lambda: _col("sizes", 1, 2**63),
    "float size": lambda: _col("sizes", 1, 1.0),
    "bool size": lambda: _col("sizes", 1, True),
    "string size": lambda: _col("sizes", 1, "1"),
    "negative mode": lambda: _col("modes", 0, -1),
    "mode with a file type": lambda: _col("modes", 0, 0o100644),
    "float mtime": lambda: _col("mtimes", 0, 1.5),
    "mtime past int64": lambda: _col("mtimes", 0, 2**63),
    "mtime below int64": lambda: _col("mtimes", 0, -(2**63) - 1),
    # paths: clean, relative, sorted, unique
    "path ..": lambda: _col("paths", 0, ".."),
    "path ../x": lambda: _col("paths", 0, "../x"),
    "path with .. inside": lambda: _col("paths", 1, "d/../b.bin"),
    "path .": lambda: _col("paths", 0, "."),
    "path with . inside": lambda: _col("paths", 1, "d/./b.bin"),
    "absolute path": lambda: _col("paths", 0, "/etc/passwd"),
    "empty path": lambda: _col("paths", 0, ""),
    "path with //": lambda: _col("paths", 1, "d//b.bin"),
    "path ending in /": lambda: _col("paths", 1, "d/b.bin/"),
    "path with NUL": lambda: _col("paths", 0, "a\x00.txt"),
    "path with a lone surrogate": lambda: _col("paths", 0, "a\udc80"),
    "path not a string": lambda: _col("paths", 0, 7),
    "paths unsorted": lambda: _with(paths=["d/b.bin", "a.txt", "d/e/c.jpg", "z"]),
    "paths repeated": lambda: _with(paths=["a.txt", "a.txt", "d/e/c.jpg", "z"]),
    # folders: the root first, clean, sorted, every parent listed, none also a file
    "dirs without the root": lambda: _with(dirs=["d", "d/e", "empty"]),
    "dirs empty": lambda: _with(dirs=[]),
    "dir ..": lambda: _with(dirs=["", "..", "d", "d/e", "empty"]),
    "dir absolute": lambda: _with(dirs=["", "/d", "d", "d/e", "empty"]),
    "dirs unsorted": lambda: _with(dirs=["", "d/e", "d", "empty"]),
    "dir whose parent is missing": lambda: _with(dirs=["", "d", "d/e", "empty", "x/y"]),
    "file whose folder is missing": lambda: _with(dirs=["", "d", "empty"]),
    "a file that is also a folder": lambda: _with(dirs=["", "d", "d/e", "empty", "z"]),
    "dir not a string": lambda: _with(dirs=["", 3]),
    # the scalar fields
    "format 2": lambda: _with(format=2),
    "format true": lambda: _with(format=True),
    "format string": lambda: _with(format="1"),
    "no format": lambda: _with(format=_DROP),
    "dataset ../x": lambda: _with(dataset="../x"),
    "dataset empty": lambda: _with(dataset=""),
    "no dataset": lambda: _with(dataset=_DROP),
    "snapshot ../x": lambda: _with(snapshot="../x"),
    "snapshot upper case": lambda: _with(snapshot="ABCDEF012345"),
    "snapshot 11 digits": lambda: _with(snapshot="0" * 11),
    "snapshot a number": lambda: _with(snapshot=12),
    "block size 0": lambda: _with(block_size=0),
    "block size negative": lambda: _with(block_size=-4096),
    "block size 2 GiB": lambda: _with(block_size=2 << 30),
    "block size float": lambda: _with(block_size=4194304.0),
    "block size bool": lambda: _with(block_size=True),
    "created negative": lambda: _with(created=-1.0),
    "created NaN": lambda: _with(created=math.nan),
    "created infinite": lambda: _with(created=math.inf),
    "created a string": lambda: _with(created="yesterday"),
    "created a 400-digit integer": lambda: _with(created=10**400),
    "paths not a list": lambda: _with(paths="a.txt"),
    "sizes an object": lambda: _with(sizes={"a.txt": 0}),
    "no versions": lambda: _with(versions=_DROP),
    "a list, not an object": lambda: [_doc()],
    "a string": lambda: "manifest",
    "null": lambda: None,
}


def test_the_valid_document_decodes() -> None:
    """The baseline every bad case differs from in one rule: it must pass."""
    doc = _doc()
    m = Manifest.from_json(doc)
    assert Manifest.decode(m.encode()) == m
    assert verify(m.encode(), doc["snapshot"], "ds") == m
    assert m.lookup("d/e/c.jpg") is not None and m.listdir("empty") == ([], [])


@pytest.mark.parametrize("case", list(BAD_DOCS))
def test_malformed_manifests_raise_manifest_error(case: str) -> None:
    doc = BAD_DOCS[case]()
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(doc)
    assert str(info.value)  # a message naming the problem
    # The same through the wire format, plain and gzip'd (NaN and Infinity are JSON here).
    raw = json.dumps(doc).encode()
    for blob in (raw, gzip.compress(raw)):
        with pytest.raises(ManifestError):
            Manifest.decode(blob)


def test_messages_name_the_problem() -> None:
    def message(doc: object) -> str:
        with pytest.raises(ManifestError) as info:
            Manifest.from_json(doc)
        return str(info.value)

    assert "'../x'" in message(_col("versions", 0, "../x")) and "version" in message(
        _col("versions", 0, "../x"))
    assert "3 sizes" in message(_with(sizes=[0, 1, 2]))
    assert "-1" in message(_col("sizes", 1, -1))
    assert "'d/../b.bin'" in message(_col("paths", 1, "d/../b.bin"))
    assert "'x'" in message(_with(dirs=["", "d", "d/e", "empty", "x/y"]))


def test_a_manifest_error_is_a_value_error_and_a_502() -> None:
    # Code that caught the decoder's ValueError still does; a spoke answers 502 with it.
    err = ManifestError("x")
    assert isinstance(err, ValueError) and isinstance(err, BadUpstream)
    assert err.status == 502 and err.to_json()["error"]["code"] == "bad_manifest"


def test_version_ids_are_exactly_what_the_hub_makes() -> None:
    from spokefs.integrity import block_digest, version_id

    made = version_id(10, 4 << 20, [block_digest(b"0123456789")])
    assert is_version_id(made) and is_version_id(version_id(0, 1, []))
    for bad in ("../x", "a/b", "", "A" * 1000, made.upper(), made[:-1], made + "0", None, 5):
        assert not is_version_id(bad)


@pytest.mark.parametrize("name,blob", [
    ("not gzip, not JSON", b"\x00\x01 garbage"),
    ("empty", b""),
    ("JSON cut short", json.dumps(_doc()).encode()[:-3]),
    ("gzip cut short", gzip.compress(json.dumps(_doc()).encode())[:-12]),
    ("gzip damaged", (lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:])(
        gzip.compress(json.dumps(_doc()).encode()))),
    ("gzip with bytes after it", gzip.compress(json.dumps(_doc()).encode()) + b"junk"),
    ("not UTF-8", b'{"format": 1, "dataset": "\xff"}'),
    ("nested too deep", b"[" * 100_000 + b"]" * 100_000),
])
def test_undecodable_blobs_raise_manifest_error(name: str, blob: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(blob)


def test_decompression_is_bounded() -> None:
    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of spaces: ~64 KiB gzip'd
    assert len(bomb) < 1 << 20
    with pytest.raises(ManifestError, match="more than"):
        gunzip(bomb, 1 << 20)
    with pytest.raises(ManifestError, match="more than"):
        Manifest.decode(bomb, max_bytes=1 << 20)
    with pytest.raises(ManifestError, match="more than"):  # plain JSON is bounded as well
        Manifest.decode(b" " * (2 << 20), max_bytes=1 << 20)
    m = Manifest.from_json(_doc())
    assert Manifest.decode(m.encode(), max_bytes=len(json.dumps(m.to_json()))) == m
    # More than one 64 MiB piece, within the bound: all of it, in order.
    big = b"".join(i.to_bytes(4, "big") * 4096 for i in range(5 * 1024))  # 80 MiB
    assert gunzip(gzip.compress(big, compresslevel=1), 100 << 20) == big
    # gzip members one after another decode as one (as gzip.decompress does)
    assert gunzip(gzip.compress(b"ab") + gzip.compress(b"cd"), 4) == b"abcd"


# -- property: whatever JSON arrives, the answer is a manifest or ManifestError -------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=5),
    max_leaves=30)
_FIELDS = ["format", "dataset", "snapshot", "created", "block_size", "paths", "sizes", "modes",
           "mtimes", "versions", "dirs"]
_paths = st.lists(st.text(alphabet="ab./\x00", max_size=6), max_size=4)


def _decode_or_manifest_error(doc: object) -> None:
    try:
        m = Manifest.from_json(doc)
    except ManifestError:
        return
    # What decoded keeps its promises: sorted, clean, one length, ids of the one form.
    assert m.paths == sorted(set(m.paths)) and len(m.paths) == len(m.versions)
    assert all(is_version_id(v) for v in m.versions)
    assert all(".." not in p.split("/") and not p.startswith("/") for p in m.paths)


@given(_json)
@settings(max_examples=300, deadline=None)
def test_any_json_decodes_or_raises_manifest_error(doc: object) -> None:
    _decode_or_manifest_error(doc)


@given(st.sampled_from(_FIELDS), _json | _paths)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_valid_manifest_with_any_one_field_replaced(field: str, value: object) -> None:
    doc = _doc()
    doc[field] = value
    _decode_or_manifest_error(doc)
    try:
        Manifest.decode(json.dumps(doc).encode())
    except ManifestError:
        pass


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_bytes_decode_or_raise_manifest_error(blob: bytes) -> None:
    for b in (blob, b"\x1f\x8b" + blob, gzip.compress(blob)):
        try:
            Manifest.decode(b)
        except ManifestError:
            pass


# -- the snapshot id: a digest of the content, checked against a real hub's ------------------

@pytest.fixture(scope="module")
def hub_manifest(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    from servers import make_dataset

    root = tmp_path_factory.mktemp("hubm")
    make_dataset(root / "data", n_small=6, big_sizes=(5_000,))
    (root / "data" / "odd..name\n").write_bytes(b"x")       # legal, if odd
    os.utime(root / "data" / "empty.txt", ns=(-(10**18), -(10**18)))  # before 1970
    state = HubState(root / "data", root / "state", "ds").open()
    try:
        snap = state.scan().snapshot.id
        return snap, state.manifest_path(snap).read_bytes()
    finally:
        state.close()


def test_a_real_hub_manifest_matches_its_snapshot_id(hub_manifest: tuple[str, bytes]) -> None:
    snap, blob = hub_manifest
    m = verify(blob, snap, "ds")
    assert m.snapshot == snap and m.content_id() == snap
    assert "odd..name\n" in m.paths and min(m.mtimes) < 0


def _tampered(blob: bytes, change: Callable[[dict], None]) -> bytes:
    doc = json.loads(gzip.decompress(blob))
    change(doc)
    return gzip.compress(json.dumps(doc).encode())


@pytest.mark.parametrize("change", [
    lambda d: d["sizes"].__setitem__(0, d["sizes"][0] + 1),
    lambda d: d["versions"].__setitem__(0, "0" * 32),
    lambda d: d["paths"].__setitem__(d["paths"].index("odd..name\n"), "odd..namf"),
    lambda d: d["mtimes"].__setitem__(1, 0),
    lambda d: d.__setitem__("block_size", 1 << 20),
])
def test_a_tampered_manifest_fails_the_snapshot_check(hub_manifest: tuple[str, bytes],
                                                      change: Callable[[dict], None]) -> None:
    snap, blob = hub_manifest
    bad = _tampered(blob, change)
    Manifest.decode(bad)  # still a well-formed manifest: only the id check catches it
    with pytest.raises(ManifestError, match="digests to"):
        verify(bad, snap, "ds")


def test_the_snapshot_check_rejects_other_ids_and_damage(hub_manifest: tuple[str, bytes]
                                                         ) -> None:
    snap, blob = hub_manifest
    other = "0" * 12 if snap != "0" * 12 else "1" * 12
    with pytest.raises(ManifestError, match="names snapshot"):
        verify(blob, other, "ds")           # a manifest of another snapshot
    with pytest.raises(ManifestError, match="dataset"):
        verify(blob, snap, "other")         # of another dataset
    with pytest.raises(ManifestError, match="not a snapshot id"):
        verify(blob, "../../etc", "ds")
    with pytest.raises(ManifestError):
        verify(blob[:len(blob) // 2], snap, "ds")  # cut short
    verify(gzip.decompress(blob), snap, "ds")  # plain JSON is checked the same way


# -- answers from an upstream are read within bounds ----------------------------------------

def test_upstream_answers_past_their_bound_are_refused(hub_manifest: tuple[str, bytes]) -> None:
    snap, blob = hub_manifest
    bomb = gzip.compress(b" " * (8 << 20))

    async def main() -> None:
        async def big_json(request: web.Request) -> web.Response:
            return web.json_response({"pad": "x" * (2 << 20)})

        async def chunked_json(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()  # no Content-Length: counted as it arrives
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b" " * 65536)
            await resp.write_eof()
            return resp

        async def manifest(request: web.Request) -> web.Response:
            body = bomb if request.match_info["snap"] == "bomb" else blob
            return web.Response(body=body, headers={"Content-Encoding": "gzip"})

        app = web.Application()
        app.router.add_get("/v1/datasets/big", big_json)
        app.router.add_get("/v1/datasets/chunked", chunked_json)
        app.router.add_get("/v1/datasets/ds/snapshots/{snap}/manifest", manifest)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        c = UpstreamClient(f"http://127.0.0.1:{port}", max_json_bytes=1 << 20,
                           max_manifest_bytes=1 << 20, max_manifest_json=4 << 20)
        try:
            with pytest.raises(BadUpstream, match="more than"):
                await c.get_json("/v1/datasets/big")       # declared too long
            with pytest.raises(BadUpstream, match="more than"):
                await c.get_json("/v1/datasets/chunked")   # grows past the bound
            m = await c.manifest("ds", snap)               # within its bounds: fine
            assert m.snapshot == snap
            with pytest.raises(ManifestError, match="more than"):
                await c.manifest("ds", "bomb")              # small as sent, huge inflated
            small = UpstreamClient(c.base_url, max_manifest_bytes=len(blob) - 1)
            with pytest.raises(BadUpstream, match="more than"):
                await small.manifest_blob("ds", snap)       # too large as sent
            await small.close()
        finally:
            await c.close()
            await runner.cleanup()

    asyncio.run(main())


def test_the_hub_side_of_the_check_is_the_same_formula(tmp_path: Path) -> None:
    """content_id is the hub's formula: a rescan of an unchanged tree keeps its id, and the
    manifest it wrote verifies (guards against the two drifting apart)."""
    from servers import make_dataset

    make_dataset(tmp_path / "data", n_small=3, big_sizes=())
    state = HubState(tmp_path / "data", tmp_path / "state", "ds").open()
    try:
        first = state.scan().snapshot.id
        (tmp_path / "data" / "new.txt").write_bytes(b"new")
        second = state.scan().snapshot.id
        assert first != second
        for snap in (first, second):
            verify(state.manifest_path(snap).read_bytes(), snap, "ds")
    finally:
        state.close()
