"""One mapping from what goes wrong talking to a peer to the exception tree (spokefs.errors).

Every client of the wire protocol uses it: the data client (``wire.http1``), the metadata
client (``wire.client``, aiohttp), the synchronous client (``client.sync``, urllib3) and the
spoke's fetcher and replica workers (through ``errors.from_status``).

- ``error_for_status``: an error answer. The peer's JSON body names its error's ``code``;
  the class with that code is rebuilt (its status must agree), else the class of the status.
  A 5xx but 501 is ``Transient`` (worth asking again) unless the caller takes every answer
  as final (the peer retried upstream itself).
- ``error_for_transport``: an exception from a socket, ssl, aiohttp or urllib3. A certificate
  that is not trusted, or a TLS handshake that cannot work, is final; everything else is
  ``Transient`` with its ``Failure`` kind, decided from exception types and errnos, never
  from message text.

Neither imports aiohttp or urllib3: an exception of theirs can only exist once they are
imported, so they are looked up in ``sys.modules``.
"""

from __future__ import annotations

import errno
import json
import math
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from spokefs.errors import (
    BadRequest,
    BadUpstream,
    ConfigError,
    Conflict,
    DigestMismatch,
    Failure,
    Forbidden,
    IntegrityError,
    LimitReached,
    ManifestError,
    NoSpace,
    NotFound,
    RangeNotSatisfiable,
    RateLimited,
    SpokeError,
    TooLarge,
    Transient,
    Unauthorized,
    UntrustedCertificate,
    UpstreamUnavailable,
    VersionGone,
)
from spokefs.wire.tls import untrusted

Body = bytes | bytearray | memoryview | dict | None
_Make = Callable[[str, dict], SpokeError]


def _simple(cls: type[SpokeError]) -> _Make:
    return lambda message, err: cls(message)


def _number(value: object, default: float) -> float:
    """A finite number the peer sent, else ``default`` (a peer's body is not trusted)."""
    try:
        n = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return default
    return n if math.isfinite(n) and abs(n) < 2**63 else default


# code -> (status it comes with, how to rebuild it): every class a peer may send.
_BY_CODE: dict[str, tuple[int, _Make]] = {
    cls.code: (cls.status, _simple(cls)) for cls in (
        NotFound, VersionGone, BadRequest, TooLarge, Unauthorized, Forbidden, LimitReached,
        IntegrityError, ConfigError, BadUpstream, UntrustedCertificate, ManifestError,
        DigestMismatch, NoSpace)}
_BY_CODE[Conflict.code] = (Conflict.status, lambda message, err: Conflict(
    message, int(_number(err["received"], 0)) if "received" in err else None))
_BY_CODE[RateLimited.code] = (RateLimited.status, lambda message, err: RateLimited(
    message, _number(err.get("retry_after"), 1.0)))
_BY_CODE[RangeNotSatisfiable.code] = (RangeNotSatisfiable.status, lambda message, err:
                                      RangeNotSatisfiable(message,
                                                          int(_number(err.get("size"), -1))))
_BY_CODE[UpstreamUnavailable.code] = (UpstreamUnavailable.status, lambda message, err:
                                      _unavailable(message, err))
# A body without a code we know (another server, a proxy): by the status alone.
_BY_STATUS: dict[int, _Make] = {
    400: _simple(BadRequest), 401: _simple(Unauthorized), 403: _simple(Forbidden),
    404: _simple(NotFound), 409: _BY_CODE[Conflict.code][1], 410: _simple(VersionGone),
    413: _simple(TooLarge), 422: _simple(DigestMismatch), 507: _simple(NoSpace),
    416: _BY_CODE[RangeNotSatisfiable.code][1], 429: _simple(LimitReached),
    502: _simple(BadUpstream), 503: _BY_CODE[UpstreamUnavailable.code][1],
    504: lambda message, err: UpstreamUnavailable(message, "", "no answer", Failure.NO_ANSWER)}

def _unavailable(message: str, err: dict) -> UpstreamUnavailable:
    cause = str(err.get("cause", ""))
    try:  # the peer sent its kind's words: the same kind here
        kind = Failure(cause) if cause else None
    except ValueError:
        kind = None
    return UpstreamUnavailable(message, str(err.get("upstream", "")), cause, kind)


def retryable(status: int) -> bool:
    """An error status worth asking again (the peer may answer later): 5xx but 501."""
    return status >= 500 and status != 501


def error_for_status(status: int, body: Body, fallback: str, *, final: bool = False
                     ) -> Exception:
    """The exception for an error answer (status >= 400) with ``body`` (bytes, or the JSON
    already decoded). ``fallback``: the message when the body has none (and a retryable
    answer's message). ``final``: every answer is the peer's last word, 5xx included."""
    if retryable(status) and not final:
        return Transient(fallback, Failure.UPSTREAM_ERROR)
    doc = body
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            doc = json.loads(bytes(body))
        except ValueError:
            doc = None
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    if not isinstance(err, dict):
        err = {}
    message = str(err.get("message") or fallback)
    by_code = _BY_CODE.get(str(err.get("code", "")))
    if by_code is not None and by_code[0] == status:
        return by_code[1](message, err)
    make = _BY_STATUS.get(status)
    if make is not None:
        return make(message, err)
    return SpokeError(f"HTTP {status}: {message}")


def raise_for_status(status: int, body: Body, what: str, *, final: bool = False) -> NoReturn:
    """Raise the error an answer with ``status`` (>= 400) to ``what`` stands for."""
    raise error_for_status(status, body, f"upstream answered {status} for {what}", final=final)


# -- transport failures --------------------------------------------------------------------------
def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps (causes, aiohttp's ``os_error``, urllib3's ``reason``),
    innermost last."""
    seen: list[BaseException] = []
    todo: list[object] = [exc]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [getattr(e, "os_error", None), getattr(e, "reason", None), e.__cause__,
                 e.__context__, *e.args]
    return iter(seen)


def _kind(e: BaseException) -> Failure | None:
    """The kind of one exception in a chain, from its type and errno; None: not telling."""
    aio, u3 = sys.modules.get("aiohttp"), sys.modules.get("urllib3.exceptions")
    if isinstance(e, socket.gaierror) or (
            aio is not None and isinstance(e, getattr(aio, "ClientConnectorDNSError", ()))) or (
            u3 is not None and isinstance(e, u3.NameResolutionError)):
        return Failure.NAME_NOT_RESOLVED
    if isinstance(e, ConnectionRefusedError):
        return Failure.REFUSED
    if isinstance(e, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return Failure.RESET
    if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return Failure.CLOSED
    if isinstance(e, TimeoutError):  # asyncio's, socket's, aiohttp's ServerTimeoutError
        return Failure.TIMED_OUT
    if aio is not None and isinstance(e, (aio.ServerDisconnectedError, aio.ClientPayloadError)):
        return Failure.CLOSED
    if u3 is not None:
        if isinstance(e, (u3.ReadTimeoutError, u3.ConnectTimeoutError)) and not isinstance(
                e, u3.NewConnectionError):  # which is a ConnectTimeoutError too, alas
            return Failure.TIMED_OUT
        if isinstance(e, u3.ProtocolError):  # a body or a connection cut short
            return Failure.CLOSED
    if isinstance(e, OSError) and e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return Failure.UNREACHABLE
    if isinstance(e, OSError) and e.errno == errno.ETIMEDOUT:
        return Failure.TIMED_OUT
    if aio is not None and isinstance(e, aio.ClientConnectorError):
        return Failure.CANNOT_CONNECT
    return None


def failure_kind(exc: BaseException) -> Failure:
    """Why a transport failed, from the innermost exception that tells."""
    for e in reversed(list(_chain(exc))):
        kind = _kind(e)
        if kind is not None:
            return kind
    return Failure.UNREACHABLE


def error_for_transport(exc: BaseException, where: str, message: str | None = None
                        ) -> Exception:
    """The exception for a failed exchange with ``where`` (host:port or base URL): a
    certificate not trusted or a TLS handshake that cannot work is final (asking again gets
    the same); anything else ``Transient`` of its kind. ``message``: the text (default: the
    exception's type and text)."""
    for e in _chain(exc):
        if isinstance(e, ssl.SSLCertVerificationError):
            return untrusted(where, e)
    for e in _chain(exc):
        if isinstance(e, ssl.SSLError) and not isinstance(
                e, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLWantReadError,
                    ssl.SSLWantWriteError)):
            return BadUpstream(f"TLS with {where} failed ({getattr(e, 'reason', None) or e}): "
                               "does it serve https there?")
    if message is None:
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return Transient(message, failure_kind(exc))
