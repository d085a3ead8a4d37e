"""An S3 (or S3-compatible) bucket as an origin: listing, and conditional ranged GETs.

Two libraries, one credential chain (docs/s3.md):

- Credentials are found the way AWS tools find them, by boto3's session: the environment
  (``AWS_ACCESS_KEY_ID`` ...), the shared profile (``AWS_PROFILE``, ``~/.aws``, SSO and
  assume-role profiles included), a web identity (a pod role), the container or instance role.
- Listing uses boto3 (``ListObjectsV2``, or ``ListObjectVersions`` where the bucket keeps
  versions): it gives keys exactly as stored (object_store's listing drops a trailing ``/``
  and empty parts, which would turn a folder marker into a file), and version ids.
- Reads use obstore (Rust object_store): chosen by measurement (``spokefs bench s3client``,
  docs/architecture.md), it spends about half the CPU of botocore per ranged GET and runs
  on the event loop without a thread per request. Its credentials come from the same boto3
  session (``Boto3CredentialProvider``, refreshed as they expire).

The endpoint of an S3-compatible store comes from ``--endpoint-url``, else
``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``; with one, requests are path-style (what
MinIO, Ceph and moto expect). No secret is ever put in a message or a log line: errors name
the bucket, the endpoint and the kind of failure, never a key or a signature.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spokefs.errors import ConfigError
from spokefs.origin.base import (
    CONNECT_TIMEOUT,
    REQUEST_TIMEOUT,
    RETRIES,
    BucketUrl,
    ObjectInfo,
    ObjectStoreOrigin,
    check_endpoint,
    obstore_options,
    parse_store_url,
    safe_url,
)

if TYPE_CHECKING:
    import obstore

log = logging.getLogger(__name__)

SCHEME = "s3://"
# Error codes that mean "these credentials are not accepted here".
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
               "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled",
               "InvalidClientTokenId", "UnrecognizedClientException", "401"}
__all__ = ["BucketUrl", "ObjectInfo", "S3Origin", "is_bucket_url", "parse_bucket_url",
           "resolve_endpoint", "safe_url"]


def is_bucket_url(source: str) -> bool:
    return source.startswith(SCHEME)


def parse_bucket_url(source: str) -> BucketUrl:
    if not is_bucket_url(source):
        raise ConfigError(f"{source!r} is not an s3:// URL (s3://BUCKET/PREFIX)")
    return parse_store_url(source)


def resolve_endpoint(endpoint: str | None) -> str | None:
    """``--endpoint-url``, else the AWS tools' variables; None means AWS itself."""
    url = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL") or None
    return None if url is None else check_endpoint(url)


class S3Origin(ObjectStoreOrigin):
    """A bucket (under a prefix): listing and conditional ranged GETs. Construction checks
    nothing on the network; ``check`` does (credentials, bucket, region)."""

    def __init__(self, url: BucketUrl, endpoint: str | None = None) -> None:
        try:
            import boto3
            import botocore.config
            import obstore  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"serving a bucket needs {exc.name}: pip install "
                              "'spokefs[s3]'") from None
        self.url = url
        self.endpoint = resolve_endpoint(endpoint)
        self.where = (f"bucket {url.bucket!r}" if self.endpoint is None
                      else f"bucket {url.bucket!r} at {self.endpoint}")
        from botocore.exceptions import BotoCoreError, ProfileNotFound

        try:
            self.session = boto3.Session()
            found = self.session.get_credentials()
        except ProfileNotFound as exc:
            raise ConfigError(f"AWS profile {exc.kwargs.get('profile')!r} (AWS_PROFILE) is "
                              "not in ~/.aws/config or ~/.aws/credentials") from None
        except BotoCoreError as exc:  # a broken profile, a failed role or SSO exchange
            log.warning("finding AWS credentials: %s", type(exc).__name__)
            raise ConfigError(f"cannot get AWS credentials for {self.where}: "
                              f"{type(exc).__name__}") from None
        if found is None:
            raise ConfigError(
                f"no AWS credentials found for {self.where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (a profile in ~/.aws), or run with "
                "an instance or pod role")
        self.region = self.session.region_name or "us-east-1"
        cfg: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT,
                               "read_timeout": REQUEST_TIMEOUT,
                               "retries": {"max_attempts": RETRIES, "mode": "standard"}}
        if self.endpoint is not None:
            cfg["s3"] = {"addressing_style": "path"}
        self._config = botocore.config.Config(**cfg)
        self._lister = self.session.client("s3", endpoint_url=self.endpoint,
                                           region_name=self.region, config=self._config)
        self._store: obstore.store.S3Store | None = None

    # -- checks and listing (blocking: call from a thread) -------------------------------
    def check(self) -> None:
        """Can these credentials list this bucket? A clear ConfigError if not (never a
        secret in it); learns the bucket's region for the reads."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self._lister.head_bucket(Bucket=self.url.bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchBucket"):
                raise ConfigError(f"{self.where} does not exist") from None
            if code in _AUTH_CODES or status in (401, 403):
                raise ConfigError(
                    f"{self.where} refused the credentials ({code or status}): check "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the role, and "
                    "that they may list the bucket (s3:ListBucket)") from None
            raise ConfigError(f"{self.where} answered {code or status} to a check") from None
        except BotoCoreError as exc:
            log.warning("checking %s: %s", self.where, exc)
            raise ConfigError(f"cannot reach {self.where}: {type(exc).__name__}") from None
        headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        region = headers.get("x-amz-bucket-region")
        if region and self.endpoint is None:
            self.region = region  # obstore does not follow a region redirect itself

    def versioned(self) -> bool:
        """Whether the bucket keeps versions (then listings pin VersionIds too). A caller
        not allowed to ask (s3:GetBucketVersioning) pins by ETag alone."""
        from botocore.exceptions import ClientError

        try:
            status = self._lister.get_bucket_versioning(Bucket=self.url.bucket).get("Status")
        except ClientError as exc:
            log.info("%s: versioning status not readable (%s): objects are pinned by ETag "
                     "alone", self.where, exc.response.get("Error", {}).get("Code"))
            return False
        return status in ("Enabled", "Suspended")

    def list(self, versions: bool) -> Iterator[ObjectInfo]:
        """Every current object under the prefix: listing requests only (1,000 keys a page),
        no request per object. ``versions``: ListObjectVersions, for VersionIds."""
        from botocore.exceptions import BotoCoreError, ClientError

        op = "list_object_versions" if versions else "list_objects_v2"
        pages = self._lister.get_paginator(op).paginate(Bucket=self.url.bucket,
                                                        Prefix=self.url.prefix)
        try:
            for page in pages:
                for o in page.get("Versions" if versions else "Contents", []):
                    if versions and not o.get("IsLatest"):
                        continue
                    vid = o.get("VersionId") if versions else None
                    yield ObjectInfo(o["Key"], int(o["Size"]), str(o.get("ETag", "")),
                                     None if vid in (None, "null") else vid,
                                     int(o["LastModified"].timestamp() * 1e9))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            raise ConfigError(f"listing {self.where} failed: {code}") from None
        except BotoCoreError as exc:
            log.warning("listing %s: %s", self.where, exc)
            raise ConfigError(f"listing {self.where} failed: {type(exc).__name__}") from None

    # -- reads (on the event loop) -------------------------------------------------------
    def _reader(self) -> obstore.store.S3Store:
        if self._store is None:
            from obstore.auth.boto3 import Boto3CredentialProvider
            from obstore.store import S3Store

            kw: dict[str, Any] = {}
            if self.endpoint is not None:
                kw.update(endpoint=self.endpoint, virtual_hosted_style_request=False,
                          allow_http=self.endpoint.startswith("http://"))
            self._store = S3Store(
                self.url.bucket, region=self.region,
                credential_provider=Boto3CredentialProvider(self.session),  # type: ignore[arg-type]
                **obstore_options(), **kw)
        return self._store
