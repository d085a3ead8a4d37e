"""Eviction policies for the spoke's block store (sans-I/O).

``make_policy("lru")`` builds one by name (lru, s3fifo, belady); ``POLICIES`` lists every
registered policy. See ``spokefs.policy.eviction`` for the rules a store and a policy agree on.
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

__all__ = [
    "POLICIES",
    "BeladyPolicy",
    "BlockKey",
    "CopiesFirst",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "make_policy",
    "register_policy",
]
