"""Which upstream serves which dataset: the spoke's routing rule (sans-I/O).

A spoke reads from one or more upstreams (hubs, or spokes of another tier), each given as
``--upstream [PATTERNS=]URL``::

    --upstream https://hub-eu.example:8470                  # every dataset not routed below
    --upstream 'scratch-*,shared=https://hub-us.example:8470'

The rule: a dataset is served by the **first** upstream, in the order given, whose patterns
match its name (``fnmatch``: ``*``, ``?``, ``[...]``); an upstream given without patterns
matches every name. A dataset that no upstream matches does not exist on this spoke (404).
So the order settles every overlap, a name never moves between upstreams while the flags
stay the same, and nothing is asked of an upstream to decide it: a region being down never
sends its datasets' reads to another one.

Each upstream gets its own token (``--upstream-token-file``, one per ``--upstream``, in the
same order), because a hub's credential goes to that hub only.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from spokefs.errors import ConfigError
from spokefs.wire.paths import NAME

# A pattern is a dataset name with fnmatch's wildcards among its characters.
_PATTERN = re.compile(r"[A-Za-z0-9._*?\[\]!-]{1,128}")


@dataclass(frozen=True)
class UpstreamSpec:
    url: str
    datasets: tuple[str, ...] = ()   # fnmatch patterns; () = every dataset
    token_file: str | None = None    # this spoke's token for this upstream only

    def matches(self, dataset: str) -> bool:
        return not self.datasets or any(fnmatch.fnmatchcase(dataset, p)
                                        for p in self.datasets)

    def describe(self) -> str:
        return f"{','.join(self.datasets)}={self.url}" if self.datasets else self.url


def parse_upstream(text: str) -> UpstreamSpec:
    """``URL`` or ``PATTERN[,PATTERN...]=URL``; ConfigError naming what is wrong."""
    head, sep, tail = text.partition("=")
    if not sep or "://" in head:  # a URL (one whose query holds "=" included)
        return UpstreamSpec(_url(text, text))
    patterns = tuple(p.strip() for p in head.split(",") if p.strip())
    if not patterns:
        raise ConfigError(f"--upstream {text!r}: no dataset pattern before '='; expected "
                          "URL or PATTERN[,PATTERN...]=URL")
    for p in patterns:
        if not _PATTERN.fullmatch(p):
            raise ConfigError(f"--upstream {text!r}: {p!r} is not a dataset name or pattern "
                              "(letters, digits, . _ - and the wildcards * ? [ ])")
    return UpstreamSpec(_url(tail, text), patterns)


def _url(url: str, text: str) -> str:
    url = url.strip()
    if not url.startswith(("http://", "https://", "s3://")):
        raise ConfigError(f"--upstream {text!r}: {url!r} is not an http(s):// URL of a hub "
                          "or spoke (or s3://BUCKET/PREFIX)")
    return url.rstrip("/")


def with_tokens(specs: Sequence[UpstreamSpec], token_files: Sequence[str]
                ) -> list[UpstreamSpec]:
    """Each upstream with its token file: none given, none sent; one per upstream, by
    position. One file for several upstreams is refused: it would hand one hub's credential
    to the others."""
    if not token_files:
        return list(specs)
    if len(token_files) != len(specs):
        raise ConfigError(
            f"{len(token_files)} --upstream-token-file for {len(specs)} --upstream: give one "
            "per upstream, in the same order (a hub's token is sent to that hub only)")
    return [UpstreamSpec(s.url, s.datasets, t) for s, t in zip(specs, token_files,
                                                                strict=True)]


class Routes:
    """The rule above, over the upstreams in their order."""

    def __init__(self, specs: Iterable[UpstreamSpec]) -> None:
        self.specs = tuple(specs)
        if not self.specs:
            raise ConfigError("a spoke needs at least one --upstream")
        urls = [s.url for s in self.specs]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"an upstream is given twice: {urls}; put all its patterns in "
                              "one --upstream PATTERN,PATTERN=URL")
        if len(self.specs) > 1 and any(s.url.startswith("s3://") for s in self.specs):
            raise ConfigError("an s3:// upstream must be the spoke's only upstream; to serve "
                              "buckets beside other datasets, serve them from a hub "
                              "(spokefs hub serve --dataset NAME=s3://...)")
        self._memo: dict[str, int | None] = {}

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def single(self) -> bool:
        return len(self.specs) == 1 and not self.specs[0].datasets

    def index(self, dataset: str) -> int | None:
        """The upstream serving ``dataset`` (its position), None: no upstream does."""
        i = self._memo.get(dataset, -1)
        if i == -1:
            i = next((n for n, s in enumerate(self.specs) if s.matches(dataset)), None)
            if NAME.fullmatch(dataset) and len(self._memo) < 65536:
                self._memo[dataset] = i
        return i

    def serves(self, i: int, dataset: str) -> bool:
        """Whether upstream ``i`` is the one for ``dataset``: its list names others' too."""
        return self.index(dataset) == i

    def url(self, dataset: str) -> str | None:
        i = self.index(dataset)
        return None if i is None else self.specs[i].url
