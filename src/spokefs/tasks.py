"""Background tasks with an owner: nothing is fire-and-forget.

A service opens one ``Tasks`` at start and closes it at stop. Every background coroutine it
runs is spawned there: a task's failure is logged once and counted (the ``failures`` counter
by task name), never lost in an unawaited future; ``keep`` runs a loop that must not die
(housekeeping) and restarts it, counted, after a pause; ``close`` cancels every task and
waits for it. Unlike ``asyncio.TaskGroup`` a failed task does not cancel its siblings: one
failed prefetch must not take a cache service down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Tasks:
    def __init__(self, on_failure: Callable[[str], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_failure = on_failure or (lambda name: None)
        self._closing = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "task",
              quiet: tuple[type[BaseException], ...] = ()) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; a failure other than ``quiet`` ones (which its
        awaiters handle) is logged and counted."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, name, quiet))
        return task

    def _done(self, task: asyncio.Task[Any], name: str,
              quiet: tuple[type[BaseException], ...]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved, so asyncio does not warn about it
        if exc is not None and not isinstance(exc, quiet) and not self._closing:
            log.error("background task %s failed: %s", name, exc, exc_info=exc)
            self._on_failure(name)

    def keep(self, loop: Callable[[], Coroutine[Any, Any, Any]], name: str,
             pause: float = 1.0) -> asyncio.Task[Any]:
        """Run ``loop()`` for as long as the owner lives; restart it after a failure."""

        async def guard() -> None:
            while True:
                try:
                    await loop()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.error("background loop %s failed (restarting in %gs): %s", name,
                              pause, exc, exc_info=exc)
                    self._on_failure(name)
                    await asyncio.sleep(pause)

        return self.spawn(guard(), name)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        self._closing = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
