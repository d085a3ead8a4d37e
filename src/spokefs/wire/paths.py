"""Validating the dataset and file paths a request names.

Files are looked up in the snapshot's manifest, never joined onto a directory, so no request
can name a byte outside the dataset. These checks still reject escape attempts loudly (400)
rather than answer them with a quiet 404.
"""

from __future__ import annotations

import re

from spokefs.errors import BadRequest

# fullmatch, not match with "$": "$" also matches before a trailing newline ("ds\n").
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def check_dataset_name(name: object) -> str:
    """``name`` if it is a dataset name (a string from a request body may be anything)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(f"invalid dataset name {_show(name)}: use letters, digits, '.', '_', "
                         "'-' (at most 128)")
    return name


def check_snapshot_id(snap: object) -> str:
    """``snap`` if it is a snapshot id or "latest" (it names a file in a spoke's cache
    folder, so nothing else: no "/" or "..")."""
    if not isinstance(snap, str) or not NAME.fullmatch(snap):
        raise BadRequest(f"invalid snapshot id {_show(snap)}")
    return snap


def split_dataset_ref(ref: str) -> tuple[str, str]:
    """ "imagenet@3fa9c1" -> ("imagenet", "3fa9c1"); "imagenet" -> ("imagenet", "latest")."""
    name, _, snap = ref.partition("@")
    check_dataset_name(name)
    return name, check_snapshot_id(snap) if snap else "latest"


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
