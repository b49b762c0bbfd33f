"""Lease renewals on a connection of their own, outside the pool.

A renewal that took a pool connection like any statement waited for one while every connection
was held (fenced transactions, transactional handlers, a pool of one), and an execution that got
none for a whole lease lost it: another process could take the record over and run the handler
again. The store's renewals now share one dedicated connection per store, opened on the first
renewal, made as the pool makes its own (its connect arguments and `connect=` callback, then its
`init` and `setup` callbacks: the same `search_path`, settings and statement cache), and closed
by the store's close. No pool checkout stands between an execution and its renewal.

They take turns on it (one short statement each, which never waits for a row lock: queries.sql
`heartbeat`), and each renewal, its turn and the connection's opening included, is bounded
(`bound`): a statement that hangs (a table lock taken by DDL, a server that stopped answering)
fails that renewal, and every renewal queued behind it once its own bound has passed, rather
than stalling every lease. A connection that broke is terminated; one a renewal timed out on is
closed once asyncpg has had the server cancel the statement (so it cannot land later). The
next renewal opens another (one attempt at a time, bounded by `CONNECT_SECONDS`; after a failed
one, none for `RETRY_SECONDS`), waiting for it half its bound at most. A renewal that finds no
connection to be had (the attempt failed or is still under way, the pool's arguments cannot be
read, the store closed) runs on the pool as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import StoreError
from .convert import (
    CONNECTION_ERRORS,
    LOCK_NOT_AVAILABLE,
    SERVER_ERROR,
    TRANSLATED,
    lock_waited,
    translate,
)
from .lifecycle import Turns
from .runner import alone

logger = logging.getLogger("idem_middleware.store")

#: The longest one renewal may take (a lease of under three times it: a third of the lease).
RENEW_SECONDS = 5.0
#: How long one attempt to open the connection may take, and the pause after a failed one
#: (renewals run on the pool meanwhile).
CONNECT_SECONDS = 5.0
RETRY_SECONDS = 5.0


def bound(lease_seconds: float) -> float:
    """How long a renewal of a lease of `lease_seconds` may take: a third of it (the pause
    between two renewals), at most `RENEW_SECONDS`."""
    return min(lease_seconds / 3, RENEW_SECONDS)


class Renewals:
    """One dedicated connection for a store's lease renewals, shared in turns."""

    __slots__ = (
        "_conn",
        "_connect",
        "_fallback",
        "_opening",
        "_retiring",
        "_retry_at",
        "_stopped",
        "_turns",
    )

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        fallback: Callable[..., Awaitable[Any]],
    ) -> None:
        # `connect()`: a new connection made as the pool makes its own, or None when that
        # cannot be done. `fallback(method, query, *args)`: the statement on a pool connection.
        self._connect = connect
        self._fallback = fallback
        self._conn: Any = None
        self._opening: asyncio.Task[Any] | None = None
        self._retry_at = 0.0
        #: Connections being closed after a renewal timed out on them (see `_retire`).
        self._retiring: set[asyncio.Task[None]] = set()
        #: Between the store's close and its next open: no connection is opened (nothing would
        #: close it); renewals run on the pool, which says whether the store is closed.
        self._stopped = False
        self._turns = Turns()

    def resume(self) -> None:
        self._stopped = False

    async def fetchval(self, seconds: float, query: str, *args: Any) -> Any:
        """`fetchval(query, *args)` on the renewals' connection (else on the pool), all of it
        within `seconds`: StoreError past them."""
        # (An opening is waited for half of `seconds` at most: the pool gets the rest.)
        patience = asyncio.get_running_loop().time() + seconds / 2
        try:
            async with asyncio.timeout(seconds):
                async with self._turns():
                    conn = self._conn
                    if conn is not None and not conn.is_closed():
                        return await self._run(conn, query, args, patience)
                    conn = await self._opened(patience)
                    if conn is not None:
                        return await self._run(conn, query, args, None)
                return await self._fallback("fetchval", query, *args)
        except TimeoutError:
            raise StoreError(f"a lease renewal took more than {seconds:g} s") from None

    async def _run(
        self, conn: Any, query: str, args: tuple[Any, ...], patience: float | None
    ) -> Any:
        """The statement on `conn`; run once more on a new connection if `conn` turns out to
        be gone and `patience` is given (a connection reused: see `_opened`)."""
        try:
            return await alone(conn.fetchval, query, *args, on=conn)
        except CONNECTION_ERRORS as exc:
            self._drop(conn)
            # (A connection the server ended while it sat idle is found out by its next
            # statement: that one runs once more, on a new connection.)
            again = None if patience is None else await self._opened(patience)
            if again is None:
                raise translate(exc) from exc
            return await self._run(again, query, args, None)
        except TRANSLATED as exc:  # (the connection is fine: a statement_timeout, a conflict)
            raise translate(exc) from exc
        except LOCK_NOT_AVAILABLE as exc:
            raise lock_waited(exc) from exc
        except SERVER_ERROR:  # (refused, on a connection that is fine: kept for the next)
            raise
        except BaseException:
            # Timed out or cancelled mid-statement: asyncpg asks the server to cancel the
            # statement (so that it does not land later); the connection is closed once it has.
            self._retire(conn)
            raise

    async def _opened(self, patience: float) -> Any:
        """A connection opened now, or None (see the module's docstring): also when the
        attempt is still under way at `patience` (on the loop's clock). One attempt at a time,
        which outlives the renewal that started it (it is not cancelled with it): a connect or
        an `init` that hangs for its whole bound held every renewal's, while the pool could
        have renewed."""
        self._conn = None
        if self._stopped:
            return None
        loop = asyncio.get_running_loop()
        opening = self._opening
        if opening is None:
            if loop.time() < self._retry_at:
                return None
            opening = self._opening = loop.create_task(self._open())
        await asyncio.wait((opening,), timeout=max(patience - loop.time(), 0.0))
        if not opening.done() or opening.cancelled():
            return None
        return opening.result()

    async def _open(self) -> Any:
        try:
            async with asyncio.timeout(CONNECT_SECONDS):
                conn = await self._connect()
        except Exception as exc:  # (the pool's `init` or `setup` may raise anything)
            logger.warning("cannot open the lease renewals' connection, using the pool: %r", exc)
            self._retry_at = asyncio.get_running_loop().time() + RETRY_SECONDS
            return None
        finally:
            self._opening = None
        if conn is None:
            logger.warning(
                "this asyncpg's pool does not say how it connects: lease renewals use the pool"
            )
            self._retry_at = math.inf  # (until the store's next open)
            return None
        if self._stopped:  # (the store closed meanwhile)
            conn.terminate()
            return None
        self._conn = conn
        return conn

    def _retire(self, conn: Any) -> None:
        """Close `conn` in the background (bounded), once the statement being cancelled on it
        has ended: cut at once, it would leave that statement's backend waiting behind its lock
        (a connection more each time), and the statement landing late."""
        if self._conn is conn:
            self._conn = None
        task = asyncio.get_running_loop().create_task(conn.close(timeout=CONNECT_SECONDS))
        self._retiring.add(task)
        task.add_done_callback(self._retired)

    def _retired(self, task: asyncio.Task[None]) -> None:
        self._retiring.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (asyncpg cut it)
            logger.debug("a lease renewals' connection did not close: %r", task.exception())

    def _drop(self, conn: Any) -> None:
        if self._conn is conn:
            self._conn = None
        with contextlib.suppress(*CONNECTION_ERRORS):
            if not conn.is_closed():
                conn.terminate()

    async def close(self, seconds: float) -> None:
        """Close the connection: after the renewal under way, with the server's goodbye, at
        most `seconds` (then it is terminated)."""
        self._stopped = True
        self._retry_at = 0.0
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await opening
        if self._retiring:
            await asyncio.wait(tuple(self._retiring), timeout=seconds)
            for task in tuple(self._retiring):
                task.cancel()  # (asyncpg cuts the connection)
        conn, self._conn = self._conn, None  # (renewals waiting for their turn: the pool's)
        if conn is None or conn.is_closed():
            return
        try:
            async with asyncio.timeout(seconds):
                async with self._turns():  # (after the renewal under way)
                    await conn.close()
        except TimeoutError:
            logger.warning("the lease renewals' connection did not close in time; terminated it")
            self._drop(conn)
