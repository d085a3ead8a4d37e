"""The exceptions a spokefs user can see.

    SpokeError                      base of everything below
    ├── NotFound                    unknown dataset, snapshot, path or version (HTTP 404)
    │                               (also a FileNotFoundError, errno ENOENT)
    ├── VersionGone                 a pinned file version the hub can no longer serve (HTTP 410)
    │                               (also an OSError, errno ESTALE: a stale handle)
    ├── BadRequest                  malformed request or path that tries to escape (HTTP 400)
    │   ├── TooLarge                a body or a list in it past its bound (HTTP 413)
    │   └── DigestMismatch          uploaded bytes that are not the version declared (HTTP 422)
    ├── Conflict                    a write out of step: an offset, a path that exists (HTTP 409)
    ├── NoSpace                     no room for a write (HTTP 507; also an OSError, ENOSPC)
    ├── RangeNotSatisfiable         a range past the end of a file (HTTP 416)
    ├── Unauthorized                no token, or an unknown one (HTTP 401)
    ├── Forbidden                   a token that does not allow the request (HTTP 403)
    │                               (both also a PermissionError, errno EACCES)
    ├── UpstreamUnavailable         upstream unreachable past the deadline (HTTP 503)
    │                               (also a ConnectionError; errno from its ``Failure`` kind)
    ├── IntegrityError              bytes that do not match their digest
    ├── ConfigError                 a bad size, duration, URL or option
    │   └── CacheLocked             a cache folder another process already uses
    └── BadUpstream                 an upstream answer refused: too large, malformed (HTTP 502)
        ├── UntrustedCertificate    an https peer whose certificate is not trusted
        └── ManifestError           a manifest that breaks a rule or does not match its id
                                    (also a ValueError)
    Transient                       an upstream failure worth retrying (not a SpokeError:
                                    it never reaches a user; retries end in UpstreamUnavailable)

The errors a client meets reading a file are also the builtin ``OSError`` a local file would
raise, so ``except FileNotFoundError`` / ``PermissionError`` / ``OSError`` work around
``spokefs.open`` and fsspec as around ``open``; their message (``str``) is unchanged.

Why a failure happened is typed (``Failure``): a ``Transient`` carries its kind, and so does the
``UpstreamUnavailable`` that retries end in; the kind, never the raw error text, is what a
client is told. Lower-level errors (aiohttp, urllib3, OSError) and HTTP statuses are mapped to
these in one place, ``spokefs.wire.errors``, with ``raise ... from exc``. Every message says
what happened and, where there is one, what to do.
"""

from __future__ import annotations

import argparse
import enum
import errno as _errno


class Failure(enum.Enum):
    """Why an upstream could not be used, in words safe to show anyone (the value): no
    address, no raw error text. Decided where the failure is seen (``spokefs.wire.errors``
    maps exception types, errnos and statuses), carried by ``Transient`` and
    ``UpstreamUnavailable``."""

    REFUSED = "connection refused"
    CANNOT_CONNECT = "cannot connect"
    RESET = "connection reset"
    CLOSED = "connection closed"
    TIMED_OUT = "timed out"
    NO_ANSWER = "no answer"
    UPSTREAM_ERROR = "upstream error"      # it answered 5xx
    NAME_NOT_RESOLVED = "name not resolved"
    BAD_ANSWER = "bad answer"              # malformed, out of step, or not what was asked
    UNREACHABLE = "unreachable"

    @classmethod
    def from_text(cls, cause: str) -> Failure:
        """The kind of a failure known only as text (a cause given by code that does not
        know its kind): a fallback; the mapping in ``spokefs.wire.errors`` types failures
        where they happen."""
        low = cause.lower()
        for needle, kind in _TEXT_KINDS:
            if needle in low:
                return kind
        return cls.UNREACHABLE

    @property
    def errno(self) -> int:
        return _FAILURE_ERRNO.get(self, _errno.EHOSTUNREACH)


_TEXT_KINDS = (("refused", Failure.REFUSED), ("cannot connect", Failure.CANNOT_CONNECT),
               ("reset", Failure.RESET), ("timed out", Failure.TIMED_OUT),
               ("timeout", Failure.TIMED_OUT), ("no answer", Failure.NO_ANSWER),
               ("sent nothing", Failure.NO_ANSWER), ("stalled", Failure.NO_ANSWER),
               ("answered 5", Failure.UPSTREAM_ERROR),
               ("name or service", Failure.NAME_NOT_RESOLVED),
               ("resolve", Failure.NAME_NOT_RESOLVED))
_FAILURE_ERRNO = {Failure.REFUSED: _errno.ECONNREFUSED, Failure.RESET: _errno.ECONNRESET,
                  Failure.CLOSED: _errno.ECONNRESET, Failure.TIMED_OUT: _errno.ETIMEDOUT,
                  Failure.NO_ANSWER: _errno.ETIMEDOUT, Failure.UPSTREAM_ERROR: _errno.EIO,
                  Failure.BAD_ANSWER: _errno.EPROTO}


class SpokeError(Exception):
    """Base class of every error spokefs raises on purpose.

    A subclass that is also a builtin ``OSError`` names its ``os_errno``: ``errno`` and
    ``strerror`` are set as the builtin's are, and ``str()`` stays the message alone."""

    status = 500
    code = "internal"
    os_errno = 0

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        if isinstance(self, OSError):
            self.strerror = str(args[0]) if args else ""
            if self.os_errno:
                self.errno = self.os_errno

    def __str__(self) -> str:
        return Exception.__str__(self)  # not OSError's "[Errno N] ..."

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.code, "message": str(self)}
        body.update(getattr(self, "details", {}))
        return {"error": body}


class NotFound(SpokeError, FileNotFoundError):
    status = 404
    code = "not_found"
    os_errno = _errno.ENOENT


class VersionGone(SpokeError, OSError):
    """The version a file was pinned to is gone: what NFS calls a stale file handle."""

    status = 410
    code = "version_gone"
    os_errno = _errno.ESTALE


class BadRequest(SpokeError):
    status = 400
    code = "bad_request"


class TooLarge(BadRequest):
    """A request body, or a list in it, past its bound (HTTP 413)."""

    status = 413
    code = "too_large"


class DigestMismatch(BadRequest):
    """An upload whose bytes do not digest to the version it declared: dropped, nothing
    published; the writer sends the file again from its first byte."""

    status = 422
    code = "digest_mismatch"


class Conflict(SpokeError):
    """A write that does not fit what the server holds: an upload resumed at another offset
    than the bytes received (``details["received"]``), a commit of a path that exists or of
    an upload not yet whole."""

    status = 409
    code = "conflict"

    def __init__(self, message: str, received: int | None = None) -> None:
        super().__init__(message)
        self.received = received
        self.details = {} if received is None else {"received": received}


class NoSpace(SpokeError, OSError):
    """No room on the server's disk (or in its quota) for the bytes of a write."""

    status = 507
    code = "no_space"
    os_errno = _errno.ENOSPC


class Unauthorized(SpokeError, PermissionError):
    """No token, or one the server does not know (spokefs.wire.auth)."""

    status = 401
    code = "unauthorized"
    os_errno = _errno.EACCES


class Forbidden(SpokeError, PermissionError):
    """A token that does not allow this request (a read token asking to purge, say)."""

    status = 403
    code = "forbidden"
    os_errno = _errno.EACCES


class LimitReached(SpokeError):
    """A table the server keeps is full (owners of announced jobs): refused, not forgotten."""

    status = 429
    code = "limit_reached"


class RateLimited(LimitReached):
    """A principal made more of a kind of request than its rate allows (``wire.ratelimit``);
    ``retry_after``: the seconds until one more is admitted."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.details = {"retry_after": round(retry_after, 3)}


class RangeNotSatisfiable(SpokeError):
    status = 416
    code = "range_not_satisfiable"

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size
        self.details = {"size": size}


class UpstreamUnavailable(SpokeError, ConnectionError):
    """``cause``: the failure as the log tells it; ``kind``: its ``Failure`` (from the cause's
    text when not given: callers that know the kind pass it)."""

    status = 503
    code = "upstream_unavailable"

    def __init__(self, message: str, upstream: str, cause: str,
                 kind: Failure | None = None) -> None:
        super().__init__(message)  # the whole story, for the log
        self.upstream = upstream
        self.cause = cause
        self.kind = kind if kind is not None else Failure.from_text(cause)

    @property
    def kind(self) -> Failure:
        return self._kind

    @kind.setter
    def kind(self, kind: Failure) -> None:
        self._kind = kind
        self.errno = kind.errno

    def to_json(self) -> dict[str, object]:
        """What a client is told: what was unavailable and the kind of failure, never the
        upstream's address or its raw error text (those are in the server's log)."""
        text, kind = str(self), self.kind.value if self.cause else ""
        if self.upstream:
            text = text.replace(f"upstream {self.upstream}", "the upstream")
            text = text.replace(self.upstream, "the upstream")
        if self.cause:
            text = text.replace(self.cause, kind)
        return {"error": {"code": self.code, "message": text, "cause": kind}}


def cause_kind(cause: str) -> str:
    """A failure's kind in a few words from its text alone ("connection refused"); kept for
    callers that have only text (``Failure.from_text``)."""
    return Failure.from_text(cause).value if cause else ""


class IntegrityError(SpokeError):
    status = 502
    code = "integrity"


class ConfigError(SpokeError, argparse.ArgumentTypeError):
    # An ArgumentTypeError too: argparse reports a bad option value with this message.
    status = 400
    code = "config"


class BadUpstream(SpokeError):
    """The upstream answered with something this side refuses to use (an answer larger than
    its bound, a malformed document). Final: asking again gets the same answer."""

    status = 502
    code = "bad_upstream"


class UntrustedCertificate(BadUpstream):
    """An https peer whose certificate this side does not trust (spokefs.wire.tls). Final:
    the message names the host and the fix; an answer to a client does not."""

    code = "tls_untrusted"

    def to_json(self) -> dict[str, object]:
        return {"error": {"code": self.code, "message": "the upstream's TLS certificate is "
                          "not trusted by this server (see its log)"}}


class ManifestError(BadUpstream, ValueError):
    """A manifest that does not decode, breaks one of its rules (spokefs.manifest), or does
    not match the snapshot id it was fetched or stored under. A ValueError too, so code that
    caught the decoder's ValueError before still does."""

    code = "bad_manifest"


class CacheLocked(ConfigError):
    """Another process (another spoke, or an embedded cache of a mount) holds the cache
    folder: two owners of one index and one set of segment files would destroy each
    other's blocks."""


class Transient(Exception):
    """A failure worth retrying: the upstream may answer later (refused, reset, silent, 5xx,
    a body cut short). ``kind``: why (from the message's text when not given)."""

    def __init__(self, message: str = "", kind: Failure | None = None) -> None:
        super().__init__(message)
        self.kind = kind if kind is not None else Failure.from_text(message)


class ReadFailed(Exception):
    """A mount's read that could not be answered; the message says why (logged with the EIO
    the reader gets)."""


def from_status(status: int, body: dict | None, fallback: str) -> SpokeError:
    """Rebuild the error a peer sent as JSON, as its final answer. Kept for its callers:
    the mapping is ``spokefs.wire.errors.error_for_status``."""
    from spokefs.wire.errors import error_for_status  # it imports this module

    err = error_for_status(status, body, fallback, final=True)
    assert isinstance(err, SpokeError)
    return err
