"""Fuzzing every route a server documents: schemathesis reads the OpenAPI document of a real
hub and of a real spoke with ``--workers 2`` (``GET /v1/openapi.json``, made from
``wire.routetable``) and sends what it generates from it, valid and invalid, to each of them
with a token of every scope (none, a stranger's, a read token of another dataset, a read
token of this one, a write token of this one, a tier member's, an admin's).

Every answer is checked against the document (its status is one the route declares, an
error is ``{"error": {"code", "message"}}``, no 5xx) and against the route table's scope:
a token the route's scope does not allow is answered 401 (a token the server does not
know) or 403, never anything else; a token it allows is never refused (but by the job's
owner, or by the hub when a spoke relays its refusal). Which route answers is worked out
from the URL the way aiohttp matches it (``_resolve``), so a generated ``/{ref}`` of ``ui``
is checked as the dashboard's route it is.

Each generated request goes to every scope in turn, the admin's last: what the admin's
purges, warm-ups and announces change is in place before the next request, for every scope
alike, never between one scope's request and another's. Generation is derandomized
(the same requests every run) and bounded (``EXAMPLES`` per route, plus schemathesis's
coverage cases), so the file runs in well under a minute and a half.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
import urllib3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from yarl import URL

from servers import hub, make_dataset, spoke
from spokefs.wire.headers import H_SNAPSHOT
from spokefs.wire.routetable import ROUTES, Owner, Route, Scope, canonical

ADMIN = "admin-" + "a" * 32
READER = "reader-" + "r" * 32     # read:ds
OTHER = "other-" + "o" * 32       # read:elsewhere (no dataset these servers have)
TIER = "tier-" + "t" * 32         # a tier member's token (the spoke's file only)
SPOKE = "spoke-" + "s" * 32       # the spoke's own token at the hub
STRANGER = "stranger-" + "x" * 32  # in no token file
WRITER = "writer-" + "w" * 32     # write:ds (the hub's ds is writable, secret is not)
# In this order for every generated request: the admin's, which may purge, last.
TOKENS = {"none": None, "stranger": STRANGER, "other": OTHER, "reader": READER,
          "writer": WRITER, "tier": TIER, "admin": ADMIN}
KNOWN = {"hub": {"other", "reader", "writer", "admin"},
         "spoke": {"other", "reader", "writer", "tier", "admin"}}
READS = {"other": {"elsewhere"}, "reader": {"ds"}, "writer": {"ds"}}  # else all
OWNERS = {"hub": {Owner.API, Owner.UI, Owner.WRITES},
          "spoke": {Owner.API, Owner.UI, Owner.SPOKE, Owner.WRITES}}
COVERAGE = 1000  # coverage cases per route, at most
# Generated requests per route (besides the coverage phase's), each sent with 6 tokens; more
# for a longer search: SPOKEFS_FUZZ_EXAMPLES=500 pytest tests/test_fuzz.py
EXAMPLES = int(os.environ.get("SPOKEFS_FUZZ_EXAMPLES", "8"))

CONFIG = {
    "seed": 22,
    "suppress-health-check": ["too_slow"],  # about slowness only: each case is 6 requests
    "request-timeout": 30,
    "max-redirects": 0,
    # Each request is sent with every token in turn (``fuzz``): none generated for the
    # document's bearer scheme, which would also leave some out on purpose.
    "generation": {"mode": "all", "max-examples": EXAMPLES, "deterministic": True,
                   "database": "none", "with-security-parameters": False},
    "phases": {"stateful": {"enabled": False}},
}
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow], print_blob=False)
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance,
          schemathesis.checks.response_schema_conformance]
# Left out: unsupported_method (every GET path is some plain read's ``/{ref}/{path}``, and a
# token the server does not know is answered 401 before any route: ``check_scope`` checks
# the 405s there are), positive_data_acceptance (a name that fits the document need not
# exist: 404), negative_data_rejection (unknown body fields are ignored on purpose:
# spoke.routes.Fields).


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fuzz")
    ds = make_dataset(root / "ds", n_small=4, big_sizes=(300_000,))
    secret = make_dataset(root / "secret", n_small=4, big_sizes=(200_000,), seed=7)
    shutil.copy(ds / "class0" / "img0000.jpg", secret / "same.jpg")  # one file in both
    (root / "hub.tokens").write_text(f"spoke read {SPOKE}\nadmin admin {ADMIN}\n"
                                     f"reader read:ds {READER}\nother read:elsewhere {OTHER}\n"
                                     f"writer write:ds {WRITER}\n")
    (root / "spoke.tokens").write_text(f"admin admin {ADMIN}\nreader read:ds {READER}\n"
                                       f"other read:elsewhere {OTHER}\ntier tier {TIER}\n"
                                       f"writer write:ds {WRITER}\n")
    (root / "spoke.token").write_text(SPOKE + "\n")
    with hub(ds, root / "hubstate", "--dataset", f"secret={secret}", "--writable", "ds",
             "--auth", str(root / "hub.tokens")) as h, \
            spoke(h.url, root / "cache", "256MiB", "--workers", "2",
                  "--auth", str(root / "spoke.tokens"),
                  "--upstream-token-file", str(root / "spoke.token")) as s:
        yield {"hub": h, "spoke": s, "known": _known_values(h.url)}


def _known_values(base: str) -> dict[str, list[Any]]:
    """Names these servers have, for generated requests to use as often as made-up ones:
    without them nearly every request would be a 404 before anything is read."""
    def get(path: str) -> dict[str, Any]:
        r = urllib3.request("GET", base + path, headers=auth(ADMIN))
        assert r.status == 200, (path, r.status, r.data[:200])
        return json.loads(r.data)

    entry = "snapshots/latest/entries"
    versions = [get(f"/v1/datasets/{d}/{entry}/{p}")["version"]
                for d, p in (("ds", "class0/img0000.jpg"), ("ds", "shards/shard-000.tar"),
                             ("secret", "class1/img0001.jpg"))]
    snap = get("/v1/datasets/ds/snapshots/latest")["id"]
    return {"ds": ["ds", "secret"], "ref": ["ds", "secret", f"ds@{snap}", "ds@latest"],
            "snap": ["latest", snap], "version": versions, "job": ["job-1", "job-2"],
            "path": ["class0/img0000.jpg", "class0", "class0/", "shards/shard-000.tar",
                     "empty.txt", "empty_dir", ""],
            "paths": [["class0/img0000.jpg"], ["class0", "shards"]],
            "prefix": ["class0", "shards/shard-000.tar", ""], "dataset": ["ds", "secret"],
            "blocks": [[[versions[0], 0]], [[versions[1], 0], [versions[2], 0]]],
            "versions": [versions[:1], versions], H_SNAPSHOT: [snap],
            "Range": ["bytes=0-99", "bytes=100000-", "bytes=-1", "bytes=0-0"]}


def _biased(schema: Any, known: dict[str, list[Any]]) -> Any:
    """Hooks of this schema: each path parameter, and each of a body's fields that names
    something (``paths``, ``blocks``...), is either what was generated or one of ``known``."""

    def either(value: Any, name: str) -> st.SearchStrategy[Any]:
        return st.one_of(st.just(value), st.sampled_from(known[name])) if name in known \
            else st.just(value)

    @schema.hook
    def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any] | None
                                ) -> st.SearchStrategy[dict[str, Any] | None]:
        if not path_parameters:
            return st.just(path_parameters)
        return st.fixed_dictionaries({k: either(v, k) for k, v in path_parameters.items()})

    @schema.hook
    def flatmap_headers(context: Any, headers: dict[str, Any] | None
                        ) -> st.SearchStrategy[dict[str, Any] | None]:
        if not headers:
            return st.just(headers)
        return st.fixed_dictionaries({k: either(v, k) for k, v in headers.items()})

    @schema.hook
    def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
        if not isinstance(body, dict):
            return st.just(body)
        return st.fixed_dictionaries({k: either(v, k) for k, v in body.items()})

    return schema


def _schema(request: pytest.FixtureRequest, role: str) -> Any:
    server = request.getfixturevalue("servers")
    loaded = schemathesis.openapi.from_url(f"{server[role].url}/v1/openapi.json",
                                           config=schemathesis.Config.from_dict(CONFIG))
    return _biased(loaded, server["known"])


@pytest.fixture(scope="module")
def spoke_schema(request: pytest.FixtureRequest) -> Any:
    return _schema(request, "spoke")


@pytest.fixture(scope="module")
def hub_schema(request: pytest.FixtureRequest) -> Any:
    return _schema(request, "hub")


# -- which route answers a URL, and whom it allows -------------------------------------------
def _pattern(path: str) -> re.Pattern[str]:
    """aiohttp's pattern of a route (``DynamicResource``): ``{x}`` is ``[^{}/]+``."""
    out = ""
    for part in re.split(r"(\{[^}]*\})", path):
        m = re.fullmatch(r"\{(\w+)(?::(.+))?\}", part)
        out += f"(?P<{m[1]}>{m[2] or '[^{}/]+'})" if m else re.escape(part)
    return re.compile(out)


def _index_key(path: str) -> str:
    key = canonical(path)
    if "{" in key:
        key = key.partition("{")[0].rpartition("/")[0]
    return key.rstrip("/") or "/"


def _resolve(role: str, method: str, url: str) -> tuple[Route | None, dict[str, str]]:
    """The table's route aiohttp matches for ``method`` and ``url`` (``UrlDispatcher.
    resolve``: the candidates of the longest matching prefix first, in the table's order)
    and its parameters; None: no route (a 404 or 405)."""
    path = URL(url, encoded=True).path_safe
    index: dict[str, list[Route]] = {}
    for r in ROUTES:
        if r.owner in OWNERS[role]:
            index.setdefault(_index_key(r.path), []).append(r)
    part = path
    while part:
        for r in index.get(part, ()):
            m = _pattern(r.path).fullmatch(path)
            if m and method in (r.method, "HEAD" if r.method == "GET" else r.method):
                return r, {k: v.replace("%2F", "/").replace("%25", "%")
                           for k, v in m.groupdict().items()}
        if part == "/":
            break
        part = part.rpartition("/")[0] or "/"
    return None, {}


def allowed(role: str, route: Route, params: dict[str, str], who: str) -> bool:
    if route.scope is Scope.PUBLIC:
        return True
    if who not in KNOWN[role]:
        return False
    ds = params.get("ds", params.get("ref", "").partition("@")[0])
    return {Scope.TOKEN: True, Scope.READ: ds in READS.get(who, {ds}),
            Scope.WRITE: who == "admin" or (who == "writer" and ds == "ds"),
            Scope.ADMIN: who == "admin", Scope.INTERNAL: who == "tier"}[route.scope]


def check_scope(role: str, who: str, response: requests.Response) -> None:
    """What the route table's scope says of this answer (see the module's docstring)."""
    req = response.request
    token = TOKENS[who]
    text = response.content.decode("utf-8", "replace")  # a file's bytes, or JSON
    what = (f"{role}, token {who!r}: {req.method} {req.url} body={str(req.body)[:300]!r} -> "
            f"{response.status_code} {text[:300]!r}")
    assert response.status_code < 500, what
    if token is not None:
        assert token not in text, what  # never echoed
    segments = URL(req.url, encoded=True).path.split("/")
    if "." in segments or ".." in segments:
        assert response.status_code == 400, what  # refused before any route is matched
        return
    route, params = _resolve(role, str(req.method), str(req.url))
    known = who in KNOWN[role]
    if route is None:
        assert response.status_code == (404 if known else 401) or (
            known and response.status_code == 405), what
        if response.status_code == 405:
            assert "allow" in {k.lower() for k in response.headers}, what  # RFC 9110
        return
    if not allowed(role, route, params, who):
        assert response.status_code == (403 if known else 401), what
        return
    if response.status_code == 403:
        owner = route.job and "was announced with token" in text
        relayed = role == "spoke" and "token 'spoke' (read)" in text
        # Any token's write to a dataset the hub does not take writes for, at the hub or
        # written back by a spoke (HEAD: no body).
        readonly = route.scope is Scope.WRITE and params.get("ds") != "ds" and (
            "is read-only on this hub" in text or "is read-only at its hub" in text
            or req.method == "HEAD")
        assert owner or relayed or readonly, what
    assert response.status_code != 401, what


def fuzz(role: str, case: schemathesis.Case) -> None:
    case.headers = {k: v for k, v in (case.headers or {}).items()
                    if k.lower() != "authorization"}  # each token's own, or none
    for who, token in TOKENS.items():
        response = case.call(headers=auth(token), timeout=30, allow_redirects=False)
        check_scope(role, who, response)
        case.validate_response(response, checks=CHECKS, headers=auth(token))
        if case.method == "GET":  # every GET answers HEAD too, as the GET does, bodiless
            sent = response.request
            head = requests.head(str(sent.url), headers=dict(sent.headers), timeout=30,
                                 allow_redirects=False)
            check_scope(role, who, head)
            assert (head.status_code, head.content) == (response.status_code, b""), (
                f"{role}, token {who!r}: HEAD {sent.url} -> {head.status_code} "
                f"{head.content[:200]!r}, GET -> {response.status_code}")


def documented() -> list[Any]:
    return [pytest.param(role, r.method, canonical(r.path), id=f"{role} {r.method} {r.path}")
            for role in OWNERS for r in ROUTES if r.owner in OWNERS[role]]


def _on_known_names(case: schemathesis.Case, known: dict[str, list[Any]], i: int) -> None:
    """A coverage case whose edge value is not in its path: its path names these servers'
    datasets, snapshots, versions and files (the ``i``-th of each), so that its body's edge
    values reach a handler instead of a 404 for a made-up dataset."""
    data = case.meta.phase.data if case.meta is not None else None
    if not case.path_parameters or getattr(data, "parameter_location", None) == "path":
        return
    case.path_parameters = {k: known[k][i % len(known[k])] if k in known else v
                            for k, v in case.path_parameters.items()}


@pytest.mark.parametrize(("role", "method", "path"), documented())
def test_every_generated_request_is_answered_within_its_document_and_scope(
        request: pytest.FixtureRequest, role: str, method: str, path: str) -> None:
    schema = request.getfixturevalue(f"{role}_schema")
    known = request.getfixturevalue("servers")["known"]
    op = schema[path][method]
    # Schemathesis's coverage phase: each parameter's and body field's edge values, valid and
    # not (deterministic; with methods the route does not answer too), then generated ones
    # (derandomized), valid and not.
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    for i, case in enumerate(itertools.islice(schema.iter_coverage_cases(
            op, generation_modes=modes, generation_config=schema.config.generation_for(
                operation=op)), COVERAGE)):
        _on_known_names(case, known, i)
        fuzz(role, case)

    @SETTINGS
    @given(st.one_of([op.as_strategy(mode) for mode in modes]))
    def generated(case: schemathesis.Case) -> None:
        fuzz(role, case)

    generated()
