"""spokefs: read a remote dataset at local speed.

``spokefs.open("http://host:port/<dataset>[@<snapshot>]/<path>")`` returns a seekable binary
file pinned to one snapshot; ``fsspec.open("spokefs://host:port/<dataset>/<path>")`` works too.
"""

from spokefs.client.file import open
from spokefs.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    IntegrityError,
    NotFound,
    RangeNotSatisfiable,
    SpokeError,
    Unauthorized,
    UpstreamUnavailable,
    VersionGone,
)

__version__ = "0.1.0"
__all__ = ["BadRequest", "ConfigError", "Forbidden", "IntegrityError", "NotFound",
           "RangeNotSatisfiable", "SpokeError", "Unauthorized", "UpstreamUnavailable",
           "VersionGone", "open"]
