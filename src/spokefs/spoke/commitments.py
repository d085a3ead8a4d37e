"""What the hub committed to for each file version, checked on every block a spoke receives.

A folder hub's version id is a digest over the file's size, the block size and every block's
digest (``integrity.version_id``), and the version id comes from the manifest of the snapshot
the spoke pinned (whose id is a digest of the manifest). So a block is accepted only if:
- its bytes match its digest (the fetcher checks that first), and
- that digest is the one the version commits to: for a one-block file, the version id of
  (the frame's object size, the block size, the digest) is the version itself; for a larger
  file, the digest is the one at the block's place in the file's digest list, a list asked of
  the upstream once per version (``POST /v1/datasets/DS/digests``) and accepted only if it
  digests to the version id.
Never against a digest that came in the same frame only: a tier member, a proxy or a hub
whose bytes changed under a snapshot cannot make a spoke keep or pass on other bytes, even
with a digest made to match them. The digest list comes from the upstream, never a member.

Datasets whose version ids are not content digests (a bucket hub's, which name a listing:
``DatasetInfo.content_ids`` false) have nothing to check against here: docs/security.md
says so.

``verdict`` is plain code (no I/O); ``learn`` asks the upstream, one request per version in
flight at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from spokefs.errors import BadUpstream
from spokefs.integrity import DIGEST_SIZE, block_count, version_id
from spokefs.policy import BlockKey
from spokefs.wire.backend import DatasetInfo

MAX_VERSIONS = 1024     # versions in one digests request
KEEP = 1 << 16          # digest lists kept (a list is 16 bytes a block: 4 KiB for 1 GiB)

Fetch = Callable[[str, list[str]], Awaitable[dict[str, object]]]


class Commitment:
    __slots__ = ("digests", "size")

    def __init__(self, size: int, digests: bytes) -> None:
        self.size = size
        self.digests = digests


def parse_commitment(version: str, doc: object, block_size: int) -> Commitment:
    """``{"size": n, "digests": hex}`` from an upstream, accepted only if it digests to
    ``version``; BadUpstream otherwise."""
    if not isinstance(doc, dict) or type(doc.get("size")) is not int \
            or not isinstance(doc.get("digests"), str):
        raise BadUpstream(f"the upstream's digests of {version} are malformed")
    size: int = doc["size"]
    try:
        digests = bytes.fromhex(doc["digests"])
    except ValueError:
        raise BadUpstream(f"the upstream's digests of {version} are not hex") from None
    n = block_count(size, block_size)
    if size < 0 or len(digests) != n * DIGEST_SIZE or version_id(
            size, block_size, (digests[i:i + DIGEST_SIZE]
                               for i in range(0, len(digests), DIGEST_SIZE))) != version:
        raise BadUpstream(f"the upstream's digests of {version} do not make that version id")
    return Commitment(size, digests)


class Commitments:
    def __init__(self, known: Callable[[str], DatasetInfo | None],
                 dataset: Callable[[str], Awaitable[DatasetInfo]], fetch: Fetch) -> None:
        self.known = known      # a dataset's info if this spoke has it now (no I/O)
        self.dataset = dataset  # the same, asked of the upstream when not
        self.fetch = fetch      # (dataset, versions) -> the upstream's {version: doc}
        self._lists: OrderedDict[str, Commitment] = OrderedDict()
        self._learning: dict[str, asyncio.Future[None]] = {}

    def verdict(self, dataset: str, key: BlockKey, digest: bytes, object_size: int
                ) -> bool | None:
        """True: the block is what the version commits to (or the dataset's version ids
        commit to nothing); False: it is not; None: not known yet (``learn`` first)."""
        info = self.known(dataset)
        if info is None:
            return None
        if not info.content_ids:
            return True
        version, index = key
        bs = info.block_size
        if object_size <= bs:  # one block (or none): the version id says it all
            return index == 0 and version in (version_id(object_size, bs, [digest]),
                                              version_id(object_size, bs, []))
        c = self._lists.get(version)
        if c is None:
            return None
        self._lists.move_to_end(version)
        at = index * DIGEST_SIZE
        return c.size == object_size and c.digests[at:at + DIGEST_SIZE] == digest

    def digests_of(self, version: str) -> Commitment | None:
        return self._lists.get(version)

    def learn(self, dataset: str, version: str) -> asyncio.Future[None]:
        """What ``verdict`` needs for ``version``, from the upstream (shared by every block
        of it that waits); fails with BadUpstream if the upstream's answer does not make the
        version id."""
        fut = self._learning.get(version)
        if fut is None:
            fut = self._learning[version] = asyncio.ensure_future(self._learn(dataset, version))
            fut.add_done_callback(lambda _f: self._learning.pop(version, None))
        return fut

    async def _learn(self, dataset: str, version: str) -> None:
        info = self.known(dataset) or await self.dataset(dataset)
        if not info.content_ids or version in self._lists:
            return
        got = await self.fetch(dataset, [version])
        self.keep(version, parse_commitment(version, got.get(version), info.block_size))

    def keep(self, version: str, c: Commitment) -> None:
        self._lists[version] = c
        while len(self._lists) > KEEP:
            self._lists.popitem(last=False)
