"""Checkpoints written through a spoke (``spoke/writeback.py``, docs/checkpoints.md): wait
until what was written is safe at the hub.

    from spokefs.checkpoint import wait_safe
    wait_safe("http://spoke:8471/ckpt/run-7/step-1200", timeout=600)
"""

from __future__ import annotations

from spokefs.client.urls import parse_url
from spokefs.errors import ConfigError


def wait_safe(url: str, timeout: float = 3600.0) -> bool:
    """True once every commit naming a file under ``url``'s folder is published at the hub;
    False if ``timeout`` seconds passed first. Raises Conflict when the hub refused one."""
    from spokefs.client.uploads import Uploader

    u = parse_url(url)
    if u.snapshot != "latest":
        raise ConfigError(f"{url}: name the dataset, not a snapshot (@{u.snapshot})")
    prefix = u.path.rstrip("/") + "/" if u.path else ""
    return Uploader(u.base, u.dataset).wait_safe(prefix, timeout)
