"""Eviction policies for the spoke's block store (sans-I/O).

``make_policy("lru")`` builds one by name (lru, s3fifo, belady); ``POLICIES`` lists every
registered policy. ``Shares`` puts a reserved share per dataset over any of them
(``spokefs.policy.shares``). See ``spokefs.policy.eviction`` for the rules a store and a
policy agree on.
"""

from spokefs.policy.eviction import (
    POLICIES,
    BeladyPolicy,
    BlockKey,
    CopiesFirst,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
    register_policy,
)
from spokefs.policy.shares import Share, Shares

__all__ = [
    "POLICIES",
    "BeladyPolicy",
    "BlockKey",
    "CopiesFirst",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "Share",
    "Shares",
    "make_policy",
    "register_policy",
]
