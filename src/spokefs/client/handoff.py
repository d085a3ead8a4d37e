"""A same-host handoff's writer side: a finished file given to the spoke by descriptor.

A writable mount on the spoke's own host (it found the spoke's cache folder: the short
circuit) stages each file it writes in a local file. Sending that file to the spoke over HTTP
reads it twice in the mount (once to digest it, once to send it) and parses it once in the
spoke. Handed over instead on ``CACHE_DIR/handoff.sock`` (``spoke.handoff``), the spoke reads it
once, straight from the staging file, and holds it exactly as a whole ``PUT .../uploads/PATH``
would have left it.

The exchange, one per connection on a ``SOCK_SEQPACKET`` unix socket: the writer sends one
message, a JSON object ``{"token", "dataset", "path", "size"}`` with the file's descriptor
(opened for reading) attached (``SCM_RIGHTS``); the spoke answers one JSON message:
``{"status": 201, "dataset", "path", "size", "version", "whole": true}``, or ``{"status": N,
"error": {...}}`` with the status and error document the HTTP route would have answered (401,
403, 404, 409, 507 ...). The token is checked as the HTTP route checks it (``write:DS`` or
admin): being on the host is not a privilege.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spokefs.errors import SpokeError, Transient, from_status

if TYPE_CHECKING:
    from spokefs.client.sync import Client

SOCKET_NAME = "handoff.sock"  # in the spoke's cache folder
MAX_MESSAGE = 64 << 10        # bytes of one request or answer
ANSWER_FLOOR_S = 60.0         # seconds an answer may take, plus the copy's time at ...
ANSWER_PACE = 50 << 20        # ... this many bytes a second (a slow disk, a busy spoke)


class HandoffUnavailable(OSError):
    """No spoke answers on the socket (none on this host, an older one, restarting): send
    the file over HTTP instead. Nothing was held by the spoke for it."""


def socket_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / SOCKET_NAME


def find_socket(client: Client, spoke_cache: Path | None = None) -> Path | None:
    """The handoff socket of the spoke ``client`` speaks to, if it runs on this host: its
    cache folder (``spoke_cache``, else the one its status names to this token) holds the
    spoke's id and passes the short circuit's test of a folder only the spoke's user can
    write (a socket in a folder anyone could write to would be shown the token). None
    otherwise, and puts go over HTTP."""
    from spokefs.cache.shared import SharedCache

    try:
        status = client.get_json("/v1/status")
    except (Transient, SpokeError):
        return None
    info = status.get("cache") if status.get("role") == "spoke" else None
    if not isinstance(info, dict) or not info.get("id"):
        return None  # a hub: written to directly
    where = spoke_cache or (Path(str(info["dir"])) if info.get("dir") else None)
    if where is None:
        return None
    cache = SharedCache(where, str(info["id"]))
    if not cache.usable() or cache.trusted_key() is None:
        return None
    return socket_path(where)


def hand_off(sock_path: Path, token: str | None, dataset: str, path: str, fd: int,
             size: int) -> dict[str, Any]:
    """``fd``'s first ``size`` bytes held whole by the spoke as an upload of ``path``; the
    spoke's answer (``version``: what they digest to). HandoffUnavailable when no spoke
    listens; the spoke's refusal as the HTTP route's error (``SpokeError``)."""
    ask = json.dumps({"token": token, "dataset": dataset, "path": path, "size": size}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(ANSWER_FLOOR_S + size / ANSWER_PACE)
        try:
            s.connect(str(sock_path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise HandoffUnavailable(exc.errno, f"no spoke listens on {sock_path}") from exc
        try:
            socket.send_fds(s, [ask], [fd])
            raw = s.recv(MAX_MESSAGE)
        except (ConnectionResetError, BrokenPipeError) as exc:
            # The spoke went away before it answered: what it copied is never whole there
            # (it writes the version last), so sending over HTTP starts clean.
            raise HandoffUnavailable(exc.errno, f"the spoke on {sock_path} went away before "
                                     "it answered") from exc
    if not raw:
        raise HandoffUnavailable(0, f"the spoke on {sock_path} closed without an answer")
    doc = json.loads(raw)
    status = int(doc.pop("status"))
    if status >= 400:
        raise from_status(status, doc, f"handoff of {path!r}")
    return dict(doc)
