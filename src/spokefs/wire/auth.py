"""Bearer tokens: who may read what, and who may change things.

A server started with ``--auth FILE`` reads one token a line, ``NAME SCOPE TOKEN`` (``#``
comments and blank lines allowed), SCOPE being ``admin``, ``read`` (every dataset) or
``read:DS1,DS2``, ``write:DS1,DS2`` (read and write of those datasets: uploads and commits
to a writable dataset, ``hub/uploads.py``), or ``tier`` (what a spoke tier's members
present to each other: the routes only the spoke's own processes and members may call, read
of every dataset, no admin; see ``wire.routetable``). The file is read again when it changes
(checked at most once a second) and on SIGHUP. Every request names its token in
``Authorization: Bearer TOKEN``; without one the answer is 401, with one that does not allow
the request 403, both saying which.

Which route needs which scope is said once, in ``wire.routetable.ROUTES``.

Clients take their token from ``SPOKEFS_TOKEN``, else from the file named by
``SPOKEFS_TOKEN_FILE`` (what ``--token-file`` sets), never from a command line. Tokens are never
logged; only their names are.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from spokefs.errors import ConfigError, Forbidden, Unauthorized
from spokefs.filestamp import Stamp, file_stamp, stamp_of

__all__ = ["Forbidden", "Token", "TokenFile", "Unauthorized", "client_token"]

log = logging.getLogger(__name__)

ENV_TOKEN = "SPOKEFS_TOKEN"
ENV_TOKEN_FILE = "SPOKEFS_TOKEN_FILE"


@dataclass(frozen=True)
class Token:
    name: str
    admin: bool
    datasets: frozenset[str] | None  # None: every dataset
    internal: bool = False  # a tier member's token, or the spoke's own processes
    writes: frozenset[str] = frozenset()  # the datasets it may write (an admin: every one)

    def may_read(self, dataset: str | None) -> bool:
        if self.admin or self.datasets is None:
            return True
        return dataset is not None and dataset in self.datasets

    def may_write(self, dataset: str | None) -> bool:
        return self.admin or (dataset is not None and dataset in self.writes)

    @property
    def scope(self) -> str:
        if self.admin:
            return "admin"
        if self.internal:
            return "tier"
        if self.writes:
            return "write:" + ",".join(sorted(self.writes))
        return "read" if self.datasets is None else "read:" + ",".join(sorted(self.datasets))


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_tokens(text: str, where: str = "token file") -> dict[bytes, Token]:
    """Tokens by the digest of their secret. ConfigError naming the line (never the secret)."""
    out: dict[bytes, Token] = {}
    names: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ConfigError(f"{where} line {n}: expected 'NAME SCOPE TOKEN' "
                              f"(got {len(parts)} fields)")
        name, scope, secret = parts
        if scope == "admin":
            token = Token(name, True, None)
        elif scope == "read":
            token = Token(name, False, None)
        elif scope == "tier":
            token = Token(name, False, None, internal=True)
        elif scope.startswith("read:") and all(scope[5:].split(",")):
            token = Token(name, False, frozenset(scope[5:].split(",")))
        elif scope.startswith("write:") and all(scope[6:].split(",")):
            writable = frozenset(scope[6:].split(","))
            token = Token(name, False, writable, writes=writable)
        else:
            raise ConfigError(f"{where} line {n}: scope {scope!r} is not admin, read, "
                              "read:DS1,DS2, write:DS1,DS2 or tier")
        if len(secret) < 16:
            raise ConfigError(f"{where} line {n}: token of {name!r} is shorter than 16 "
                              "characters; use e.g. `openssl rand -hex 24`")
        if name in names:
            raise ConfigError(f"{where} line {n}: a second token named {name!r}")
        names.add(name)
        out[_digest(secret)] = token
    if not out:
        raise ConfigError(f"{where} has no tokens: a server with --auth would refuse everyone")
    return out


class TokenFile:
    """The server's tokens, read again when the file changes (or on ``reload()``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: Stamp | None = None
        self._checked = 0.0
        self._tokens: dict[bytes, Token] = {}
        self.reload(strict=True)

    def reload(self, strict: bool = False) -> None:
        """Read the file. At start a bad file is an error; later, a bad edit keeps the tokens
        in force and says why in the log."""
        try:
            st = os.stat(self.path)
            tokens = parse_tokens(self.path.read_text(), str(self.path))
        except (OSError, ConfigError) as exc:
            if strict:
                raise ConfigError(f"cannot use --auth {self.path}: {exc}") from exc
            log.error("auth: keeping the tokens in force; %s could not be used: %s",
                      self.path, exc)
            return
        if self._tokens and tokens != self._tokens:
            log.info("auth: %d tokens from %s", len(tokens), self.path)
        self._tokens = tokens
        self._stamp = stamp_of(st)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        self._checked = now
        stamp = file_stamp(self.path)
        if stamp is not None and stamp != self._stamp:
            self.reload()

    def check(self, header: str | None) -> Token:
        """The token an ``Authorization`` header presents, or Unauthorized."""
        self._maybe_reload()
        if not header or not header.startswith("Bearer "):
            raise Unauthorized("this server needs a token: send 'Authorization: Bearer TOKEN' "
                               f"(clients: set {ENV_TOKEN} or use --token-file)")
        presented = _digest(header[7:].strip())
        found = None
        for digest, token in self._tokens.items():  # every entry compared: constant time
            if hmac.compare_digest(digest, presented):
                found = token
        if found is None:
            raise Unauthorized("the token presented is not one this server knows")
        return found


FROM_ENV = object()  # a client's token argument by default: client_token()


def client_token() -> str | None:
    """The token a client presents: ``SPOKEFS_TOKEN``, else the file ``SPOKEFS_TOKEN_FILE``
    names (its first non-blank line), else None."""
    token = os.environ.get(ENV_TOKEN)
    if token:
        return token.strip()
    path = os.environ.get(ENV_TOKEN_FILE)
    if path:
        return read_token_file(Path(path))
    return None


def read_token_file(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text().splitlines() if x.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if not lines:
        raise ConfigError(f"the token file {path} is empty")
    return lines[0]


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def check_bind(host: str, auth: Path | None, insecure: bool, role: str) -> None:
    """Without --auth a server answers anyone who can reach it: loopback only, unless the
    operator says --insecure."""
    if auth is None and host not in LOOPBACK and not insecure:
        raise ConfigError(f"refusing to serve on {host} without --auth: anyone who can reach "
                          f"it could read every dataset and purge or warm the {role}; give "
                          "--auth FILE, or --insecure on a network you trust")
    if auth is None:
        log.warning("%s: no --auth: every request is allowed (%s)", role,
                    "loopback only" if host in LOOPBACK else "--insecure")
