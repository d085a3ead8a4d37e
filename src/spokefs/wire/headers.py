"""The protocol's own HTTP header names: one place that servers and clients both import."""

H_BLOCK_SIZE = "X-Spokefs-Block-Size"
H_DIGEST = "X-Spokefs-Block-Digest"  # hex xxh3-128 of the block, on single-block reads
H_VERSION = "X-Spokefs-Version"
# The snapshot a read resolved to (answers), or the one a reader reads from (requests: a
# spoke keeps a snapshot's files cached while readers name it).
H_SNAPSHOT = "X-Spokefs-Snapshot"
H_READER = "X-Spokefs-Reader"  # names one sequential stream (a worker, a file handle)
H_JOB = "X-Spokefs-Job"        # names the training job, for announced orders and learning
# A replica worker forwards a reader's request to its primary (over the Unix socket) with
# this mark and the reader's own Authorization header: the primary checks the token again.
H_FORWARDED = "X-Spokefs-Forwarded"
# The cache folder's key (``cache/store.py``, ``internal.key``): what a same-host reader of
# the cache files (a mount's short circuit) presents for the internal routes.
H_INTERNAL = "X-Spokefs-Internal"
# On a batch read from one tier member to another (``demand`` or ``prefetch``): the answering
# member serves it from its cache or its upstream, never from another member (no loops);
# ``copy``: from its cache only (a handoff).
H_PEER = "X-Spokefs-Peer"
H_MEMBER = "X-Spokefs-Member"  # the asking tier member's URL, with X-Spokefs-Peer
# An upload (``hub/uploads.py``): the whole file's size, and where this body starts in it.
# The version it must digest to is ``H_VERSION``.
H_SIZE = "X-Spokefs-Size"
H_OFFSET = "X-Spokefs-Offset"
