"""Parsing spokefs URLs: ``http://host:port/<dataset>[@<snapshot>][/<path>]``."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from spokefs.errors import ConfigError
from spokefs.wire.paths import clean_path, split_dataset_ref


@dataclass(frozen=True, slots=True)
class DatasetURL:
    base: str       # http://host:port
    dataset: str
    snapshot: str   # an id or "latest"
    path: str       # "" for the dataset's root


def parse_url(url: str, default_scheme: str = "http") -> DatasetURL:
    if "://" not in url:
        url = f"{default_scheme}://{url}"
    parts = urlsplit(url)
    scheme = "http" if parts.scheme in ("spokefs", "http") else parts.scheme
    if scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"not a spokefs URL: {url!r} "
                          "(expected http://host:port/<dataset>[@<snapshot>]/<path>)")
    ref, _, path = unquote(parts.path).lstrip("/").partition("/")
    if not ref:
        raise ConfigError(f"URL {url!r} names no dataset")
    dataset, snap = split_dataset_ref(ref)
    return DatasetURL(f"{scheme}://{parts.netloc}", dataset, snap, clean_path(path))
