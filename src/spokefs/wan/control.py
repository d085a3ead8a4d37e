"""The WAN emulator's control port: read counters, cut and heal the link, change it live.

    GET  /status          settings, cut state, counters (JSON)
    POST /cut             {"reset_after": 5}   refuse new connections, stall open ones
    POST /restore         heal the link
    POST /set             {"rtt": "60ms", "bandwidth": "200MB/s", "jitter": 0, "window": 0}
    POST /reset-counters  zero bytes_up, bytes_down, connections, refused, resets

Every POST answers with the status after the change; a bad body is a 400 with the usual
``{"error": {...}}`` body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from spokefs.errors import BadRequest, ConfigError, SpokeError
from spokefs.units import parse_duration
from spokefs.wire.bodies import json_body

if TYPE_CHECKING:
    from spokefs.wan.proxy import WanLink

MAX_BODY = 1 << 20  # a control body is a few fields (aiohttp's own default bound)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _body(request: web.Request) -> dict[str, Any]:
    body = await json_body(request, MAX_BODY)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def build_app(wan: WanLink) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        return web.json_response(wan.status())

    async def cut(request: web.Request) -> web.Response:
        body = await _body(request)
        reset_after = body.get("reset_after", 5.0)
        if isinstance(reset_after, bool) or not isinstance(reset_after, int | float | str):
            raise ConfigError(f"reset_after must be seconds or a duration like '5s', got "
                              f"{reset_after!r}")
        wan.cut(reset_after=parse_duration(reset_after))
        return web.json_response(wan.status())

    async def restore(request: web.Request) -> web.Response:
        wan.restore()
        return web.json_response(wan.status())

    async def set_(request: web.Request) -> web.Response:
        wan.set(**await _body(request))
        return web.json_response(wan.status())

    async def reset_counters(request: web.Request) -> web.Response:
        wan.reset_counters()
        return web.json_response(wan.status())

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except SpokeError as exc:
            return web.json_response(exc.to_json(), status=exc.status)

    app = web.Application(middlewares=[errors])
    app.router.add_get("/status", status)
    app.router.add_post("/cut", cut)
    app.router.add_post("/restore", restore)
    app.router.add_post("/set", set_)
    app.router.add_post("/reset-counters", reset_counters)
    return app


async def start_control(wan: WanLink, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the control app on host:port (0: a free port); return the runner and the port."""
    runner = web.AppRunner(build_app(wan), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
