"""The dashboard page (``/ui``), served by hub and spoke alike.

Three static files shipped in the package (index.html, app.js, style.css): no build step and
nothing fetched from the internet. The page polls ``/v1/status`` and ``/metrics`` of the
server that served it and draws the charts itself (see docs/dashboard.md).

The page and its files carry no data, so they are served without a token even when the
server runs with ``--auth`` (scope ``public`` in ``wire.routetable``); the
data calls it makes need one, which a person types into the page.
"""

from __future__ import annotations

import functools
from importlib import resources

from aiohttp import web

_TYPES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
# What the page may load: its own files and the same server's data; no inline script, no
# other origin (a page for operators must not be a way to run someone else's code).
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@functools.cache
def _file(name: str) -> bytes:
    return (resources.files(__package__) / name).read_bytes()


def _serve(name: str) -> web.Response:
    return web.Response(body=_file(name), content_type=_TYPES[name], charset="utf-8",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP,
                                 "X-Content-Type-Options": "nosniff"})


async def redirect(request: web.Request) -> web.Response:
    # The page lives at /ui/ so that its relative links (app.js, ../v1/status) also work
    # behind a proxy that serves this server under a prefix.
    raise web.HTTPFound("ui/")


async def page(request: web.Request) -> web.Response:
    return _serve("index.html")


async def script(request: web.Request) -> web.Response:
    return _serve("app.js")


async def style(request: web.Request) -> web.Response:
    return _serve("style.css")
