"""TLS: a server's certificate, and what a client trusts.

A server takes ``--tls-cert FILE --tls-key FILE`` and then speaks only https. A client trusts
the system's certificate authorities, or the bundle in ``SPOKEFS_CA_BUNDLE`` (what
``spokefs --ca-bundle FILE`` sets, so a mount or a spoke's workers inherit it). A certificate
that is not trusted is a final error naming the host and what to do, never a retry.
"""

from __future__ import annotations

import functools
import os
import ssl
from pathlib import Path

from spokefs.errors import ConfigError, UntrustedCertificate

ENV_CA_BUNDLE = "SPOKEFS_CA_BUNDLE"


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use --tls-cert {cert} --tls-key {key}: {exc}") from exc
    return ctx


@functools.cache
def _client_context(bundle: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=bundle)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use the CA bundle {bundle}: {exc}") from exc


def client_context() -> ssl.SSLContext:
    """What https connections of this process trust (SPOKEFS_CA_BUNDLE, else the system)."""
    return _client_context(os.environ.get(ENV_CA_BUNDLE) or None)


def untrusted(host: str, exc: BaseException) -> UntrustedCertificate:
    return UntrustedCertificate(f"TLS: the certificate of {host} is not trusted ({exc}); if it is "
                       f"signed by your own authority, give spokefs --ca-bundle FILE (or "
                       f"{ENV_CA_BUNDLE})")
