"""The WAN link emulator: a userspace TCP proxy with delay, a shared bandwidth cap and cuts.

``WanLink`` runs inside your event loop, ``WanLinkThread`` in a thread of its own; the timing
model lives, socket-free, in ``spokefs.wan.link``. See docs/wan.md.
"""

from spokefs.wan.link import LinkConfig
from spokefs.wan.proxy import WanLink, WanLinkThread, WanStats

__all__ = ["LinkConfig", "WanLink", "WanLinkThread", "WanStats"]
