"""Validating the dataset and file paths a request names.

Files are looked up in the snapshot's manifest, never joined onto a directory, so no request
can name a byte outside the dataset. These checks still reject escape attempts loudly (400)
rather than answer them with a quiet 404.
"""

from __future__ import annotations

import re

from spokefs.errors import BadRequest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_dataset_name(name: str) -> str:
    if not _NAME.match(name):
        raise BadRequest(f"invalid dataset name {name!r}: use letters, digits, '.', '_', '-'")
    return name


def split_dataset_ref(ref: str) -> tuple[str, str]:
    """ "imagenet@3fa9c1" -> ("imagenet", "3fa9c1"); "imagenet" -> ("imagenet", "latest")."""
    name, _, snap = ref.partition("@")
    check_dataset_name(name)
    if snap and not _NAME.match(snap):
        raise BadRequest(f"invalid snapshot id {snap!r}")
    return name, snap or "latest"


def clean_path(path: str) -> str:
    """A manifest-relative path ("a/b.jpg") from a decoded URL path; reject escapes."""
    if "\x00" in path or "\\" in path:
        raise BadRequest("path contains a NUL byte or a backslash")
    parts = path.split("/")
    if path.startswith("/") and path.strip("/"):
        raise BadRequest(f"absolute path {path!r}: paths are relative to the dataset")
    if any(p in (".", "..") for p in parts):
        raise BadRequest(f"path {path!r} contains '.' or '..' segments")
    return "/".join(p for p in parts if p)
