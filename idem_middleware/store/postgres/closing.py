"""Closing the store: the lease-mode executions a shutdown cancelled settle first, and the pool's
close is bounded (a server that does not answer would hold it for ever)."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

logger = logging.getLogger("idem_middleware.store")

#: How long `close` may take in all: waiting for cancelled lease-mode executions to settle, the
#: LISTEN connection's goodbye, the pool's (its connections given back, each closed with the
#: server's goodbye). Each step past the first gets what is left, and at least `LAST_SECONDS`.
CLOSE_SECONDS = 10.0
LAST_SECONDS = 0.5


class Budget:
    """What is left of `CLOSE_SECONDS` (read when `close` starts, so a test may shorten it)."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until = asyncio.get_running_loop().time() + CLOSE_SECONDS

    def left(self) -> float:
        return max(self._until - asyncio.get_running_loop().time(), LAST_SECONDS)


class Executions:
    """The tasks that claimed a lease-mode record through the store (a request's, a job's).

    A server's shutdown cancels the requests still running, then closes the app (the store)
    at once, without waiting for them: an execution still unwinding then found the store closed
    and could not mark its record `unknown`, which stayed `pending` (its retries answered 409)
    until its lease lapsed. `close` waits for those (only the cancelled ones: a task that runs
    on, a queue consumer's, is the app's to stop)."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    def add(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    async def unwound(self, seconds: float) -> None:
        """Wait (at most `seconds`) for the cancelled executions to finish."""
        current = asyncio.current_task()
        loop = asyncio.get_running_loop()
        unwinding = [
            t
            for t in self._tasks
            if t is not current and t.get_loop() is loop and not t.done() and t.cancelling()
        ]
        if not unwinding:
            return
        _, pending = await asyncio.wait(unwinding, timeout=seconds)
        if pending:
            logger.warning(
                "closing the store: %d cancelled lease-mode executions did not finish within "
                "%.0f s; their records stay pending until their leases lapse",
                len(pending),
                seconds,
            )


async def close_pool(pool: Any, seconds: float) -> None:
    """`pool.close()` (it waits for its connections to come back, then says goodbye on each),
    bounded: past `seconds` (a server that does not answer, a connection never given back)
    the pool's connections are terminated."""
    try:
        async with asyncio.timeout(seconds):
            await pool.close()
    except TimeoutError:
        # (asyncpg has terminated the pool on the cancellation already; this is for the others.)
        pool.terminate()
        logger.warning("the pool did not close within %.0f s; its connections were cut", seconds)
