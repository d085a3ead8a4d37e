"""Log output: plain lines for people (the default), or JSON lines for log collectors.

``spokefs --log-format json ...`` (or ``SPOKEFS_LOG_FORMAT=json``) writes one JSON object per
line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, then any fields a call
passed with ``extra={...}`` (e.g. ``event``, ``dataset``), and ``exception`` when there is one.
The choice is put back into the environment, so the processes a command starts (workers,
mounts, benchmark services) log the same way; so is the level (``-v`` debug, default info,
``-q`` warning, ``-qq`` error, or ``--log-level``; ``SPOKEFS_LOG_LEVEL``).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from typing import Any

ENV_LOG_FORMAT = "SPOKEFS_LOG_FORMAT"
ENV_LOG_LEVEL = "SPOKEFS_LOG_LEVEL"
FORMATS = ("plain", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
PLAIN = "%(asctime)s %(name)s %(levelname)s %(message)s"

# Attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        # default=str: an extra field that JSON cannot hold (a Path, an exception) is text.
        return json.dumps(doc, default=str, ensure_ascii=False)


def log_format(choice: str | None = None) -> str:
    """The format asked for: ``choice``, else the environment, else plain."""
    fmt = (choice or os.environ.get(ENV_LOG_FORMAT) or "plain").strip().lower()
    if fmt not in FORMATS:
        from spokefs.errors import ConfigError

        raise ConfigError(f"log format {fmt!r}: use one of {', '.join(FORMATS)} "
                          f"(--log-format or {ENV_LOG_FORMAT})")
    return fmt


def level_for(verbose: int, quiet: int, name: str | None = None, counts_rank: int = 0,
              name_rank: int = 0) -> int:
    """The level asked for: info, one step down per ``-v`` (debug is the lowest), one step up
    per ``-q`` (error the highest); ``--log-level name`` instead unless the counts came from a
    stronger source (a flag beats the environment, which beats a config file: the ranks)."""
    if name is not None and (name_rank >= counts_rank or not (verbose or quiet)):
        return logging.getLevelName(name.upper())  # type: ignore[no-any-return]
    return min(max(logging.INFO + 10 * (quiet - verbose), logging.DEBUG), logging.ERROR)


def env_level() -> int:
    """The level a parent exported (``SPOKEFS_LOG_LEVEL``), else info."""
    name = (os.environ.get(ENV_LOG_LEVEL) or "info").strip().lower()
    return level_for(0, 0, name if name in LEVELS else None)


def setup_logging(level: int, fmt: str | None = None) -> str:
    """Configure the root logger (stderr) in ``fmt`` at ``level``; returns the format used
    and exports both to child processes."""
    fmt = log_format(fmt)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN))
    logging.basicConfig(level=level, handlers=[handler])  # a no-op where handlers exist
    os.environ[ENV_LOG_FORMAT] = fmt
    os.environ[ENV_LOG_LEVEL] = logging.getLevelName(level).lower()
    return fmt
