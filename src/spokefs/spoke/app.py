"""Wiring the spoke service into an aiohttp application."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from spokefs.spoke.config import SpokeConfig
from spokefs.spoke.handoff import HandoffServer
from spokefs.spoke.routes import SpokeRoutes, WriteRoutes
from spokefs.spoke.service import SpokeBackend
from spokefs.spoke.tier import peer_middleware
from spokefs.wire.authz import JobOwners
from spokefs.wire.routetable import Owner
from spokefs.wire.run import serve_forever
from spokefs.wire.server import AUTH_KEY, RELOAD_KEY, build_app


def build_spoke_app(backend: SpokeBackend) -> web.Application:
    auth = backend.config.auth
    app = build_app(backend, {Owner.SPOKE: SpokeRoutes(backend),
                                       Owner.WRITES: WriteRoutes(backend)}, counts=backend,
                    auth=Path(auth) if auth else None, jobs=JobOwners(), audit=backend.audit,
                    internal_key=lambda: backend.store.key,
                    batch_memory=backend.config.batch_memory)
    app[RELOAD_KEY] = [backend.dataset_rules.reload]
    if backend.tier is not None:  # innermost: after the token was checked
        app.middlewares.append(peer_middleware)

    async def lifecycle(app: web.Application):
        await backend.start()
        handoff = HandoffServer(backend.config.cache_dir, backend.writeback, app.get(AUTH_KEY),
                                backend.audit, asyncio.get_running_loop())
        handoff.start()
        yield
        handoff.close()
        await backend.close()

    app.cleanup_ctx.append(lifecycle)
    return app


async def run_spoke(config: SpokeConfig, host: str, port: int) -> None:
    await serve_forever(build_spoke_app(SpokeBackend(config)), host, port, "spoke",
                        tls=config.tls())
