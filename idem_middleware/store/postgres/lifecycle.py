"""The store's opens and closes: one at a time, nested, and in the event loop of its pool; the
pool made once the server accepts connections."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

from ...errors import OTHER_LOOP, ConfigurationError, StoreClosed

logger = logging.getLogger("idem_middleware")

#: How often a server that cannot accept connections yet is asked again (`pool_when_ready`).
READY_POLL = 0.25


class Turns:
    """One open or close of a store at a time. A second `close` returned while the first was
    still closing the pool, and a `close` during an `open` found no pool yet and did nothing,
    so the pool the `open` then made stayed open. Each now waits for the one under way. (A
    lock per event loop: an asyncio.Lock waited on in one loop refuses every other, and a
    store may be opened again in another loop once it is closed.)"""

    __slots__ = ("_lock", "_loop")

    def __init__(self) -> None:
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:
            self._lock, self._loop = asyncio.Lock(), loop
        return self._lock


def other_loop(pool: Any) -> bool:
    """Whether `pool` (an asyncpg pool) belongs to another event loop than the running one.
    Its connections work only in their own: used from another (a store opened in one test
    fixture's loop and used in the test's, an app served by Starlette's TestClient in a loop of
    its own), asyncpg failed with "attached to a different loop" or "another operation is in
    progress" out of the middleware (a 500), leaving the connections broken."""
    running = asyncio._get_running_loop()
    return running is not None and getattr(pool, "_loop", running) is not running


def refuse_other_loop(pool: Any, doing: str) -> None:
    """ConfigurationError when opening in another loop than the pool's (see `other_loop`)."""
    if other_loop(pool):
        raise ConfigurationError(f"cannot {doing}: {OTHER_LOOP}")


def check_loop(pool: Any) -> None:
    """StoreClosed (a 503 whose log says why) when `pool` belongs to another loop."""
    if other_loop(pool):
        raise StoreClosed(OTHER_LOOP)


async def pool_when_ready(dsn: str | None, options: dict[str, Any], seconds: float) -> Any:
    """asyncpg's pool, made once the server accepts connections. A server that says it cannot
    yet (57P03: starting up, in crash recovery after a restart) is asked again for up to
    `seconds` (the store's `acquire_timeout`), with a warning: before, a worker that started
    while its database restarted failed its startup, and uvicorn stopped every worker with it.
    Any other refusal is raised at once, as is this one past `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    for attempt in range(int(seconds / READY_POLL) + 2):  # (and the deadline)
        try:
            return await asyncpg.create_pool(dsn, **options)
        except asyncpg.CannotConnectNowError as exc:
            if loop.time() + READY_POLL > deadline:
                raise
            if attempt == 0:
                logger.warning(
                    "PostgreSQL cannot accept connections yet (%s): the store asks again for up "
                    "to %g s",
                    exc,
                    seconds,
                )
        await asyncio.sleep(READY_POLL)
    raise TimeoutError(f"PostgreSQL did not accept connections within {seconds:g} s")
