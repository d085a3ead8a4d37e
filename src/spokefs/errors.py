"""The exceptions a spokefs user can see.

    SpokeError                      base of everything below
    ├── NotFound                    unknown dataset, snapshot, path or version (HTTP 404)
    ├── VersionGone                 a pinned file version the hub can no longer serve (HTTP 410)
    ├── BadRequest                  malformed request or path that tries to escape (HTTP 400)
    │   └── TooLarge                a body or a list in it past its bound (HTTP 413)
    ├── RangeNotSatisfiable         a range past the end of a file (HTTP 416)
    ├── Unauthorized                no token, or an unknown one (HTTP 401)
    ├── Forbidden                   a token that does not allow the request (HTTP 403)
    ├── UpstreamUnavailable         upstream unreachable past the deadline (HTTP 503)
    ├── IntegrityError              bytes that do not match their digest
    ├── ConfigError                 a bad size, duration, URL or option
    │   └── CacheLocked             a cache folder another process already uses
    └── BadUpstream                 an upstream answer refused: too large, malformed (HTTP 502)
        ├── UntrustedCertificate    an https peer whose certificate is not trusted
        └── ManifestError           a manifest that breaks a rule or does not match its id
                                    (also a ValueError)
    Transient                       an upstream failure worth retrying (not a SpokeError:
                                    it never reaches a user; retries end in UpstreamUnavailable)

Lower-level errors (aiohttp, urllib3, OSError) are mapped to these at the boundary with
``raise ... from exc``. Every message says what happened and, where there is one, what to do.
"""

from __future__ import annotations

import argparse


class SpokeError(Exception):
    """Base class of every error spokefs raises on purpose."""

    status = 500
    code = "internal"

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.code, "message": str(self)}
        body.update(getattr(self, "details", {}))
        return {"error": body}


class NotFound(SpokeError):
    status = 404
    code = "not_found"


class VersionGone(SpokeError):
    status = 410
    code = "version_gone"


class BadRequest(SpokeError):
    status = 400
    code = "bad_request"


class TooLarge(BadRequest):
    """A request body, or a list in it, past its bound (HTTP 413)."""

    status = 413
    code = "too_large"


class Unauthorized(SpokeError):
    """No token, or one the server does not know (spokefs.wire.auth)."""

    status = 401
    code = "unauthorized"


class Forbidden(SpokeError):
    """A token that does not allow this request (a read token asking to purge, say)."""

    status = 403
    code = "forbidden"


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


class UpstreamUnavailable(SpokeError):
    status = 503
    code = "upstream_unavailable"

    def __init__(self, message: str, upstream: str, cause: str) -> None:
        super().__init__(message)  # the whole story, for the log
        self.upstream = upstream
        self.cause = cause

    def to_json(self) -> dict[str, object]:
        """What a client is told: what was unavailable and the kind of failure, never the
        upstream's address or its raw error text (those are in the server's log)."""
        text, kind = str(self), cause_kind(self.cause)
        if self.upstream:
            text = text.replace(f"upstream {self.upstream}", "the upstream")
            text = text.replace(self.upstream, "the upstream")
        if self.cause:
            text = text.replace(self.cause, kind)
        return {"error": {"code": self.code, "message": text, "cause": kind}}


_CAUSE_KINDS = (("refused", "connection refused"), ("cannot connect", "cannot connect"),
                ("reset", "connection reset"),
                ("timed out", "timed out"), ("timeout", "timed out"),
                ("no answer", "no answer"), ("sent nothing", "no answer"),
                ("stalled", "no answer"), ("answered 5", "upstream error"),
                ("name or service", "name not resolved"), ("resolve", "name not resolved"))


def cause_kind(cause: str) -> str:
    """A failure's kind in a few words, safe to show anyone ("connection refused")."""
    low = cause.lower()
    for needle, kind in _CAUSE_KINDS:
        if needle in low:
            return kind
    return "unreachable" if cause else ""


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
    a body cut short)."""


class ReadFailed(Exception):
    """A mount's read that could not be answered; the message says why (logged with the EIO
    the reader gets)."""


def from_status(status: int, body: dict | None, fallback: str) -> SpokeError:
    """Rebuild the error a peer sent as JSON (client side of the wire protocol)."""
    err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
    message = str(err.get("message") or fallback)
    if status == 404:
        return NotFound(message)
    if status == 410:
        return VersionGone(message)
    if status == 416:
        return RangeNotSatisfiable(message, int(err.get("size", -1)))
    if status == 401:
        return Unauthorized(message)
    if status == 403:
        return Forbidden(message)
    if status == 400:
        return BadRequest(message)
    if status == 413:
        return TooLarge(message)
    if status == 429:
        return LimitReached(message)
    if status == 502:
        return BadUpstream(message)
    if status == 503:
        return UpstreamUnavailable(message, str(err.get("upstream", "")), str(err.get("cause", "")))
    return SpokeError(f"HTTP {status}: {message}")
