"""Lease renewals on a connection of their own, outside the pool.

A renewal that took a pool connection like any statement waited for one while every connection
was held (fenced transactions, transactional handlers, a pool of one), and an execution that got
none for a whole lease lost it: another process could take the record over and run the handler
again. The store's renewals now share one dedicated connection per store, opened on the first
renewal, made as the pool makes its own (its connect arguments and `connect=` callback, then its
`init` and `setup` callbacks: the same `search_path`, settings and statement cache), and closed
by the store's close. No pool checkout stands between an execution and its renewal.

They take turns on it (one short statement a turn, which never waits for a row lock: queries.sql
`heartbeat`). A renewal that finds the connection free goes alone, in that statement; those that
arrive while it is busy wait together, and the next turn sends them all (up to `BATCH`) in one
statement (`heartbeat_batch`, the same answer for each), run by a task of its own (`_drain`):
one renewal a round trip capped a process at about 500 executions on 30 s leases at a 20 ms
round trip. Each renewal, its turn and the connection's opening included, is bounded (`bound`):
one whose bound passes fails alone (in a batch, the others go on: a batch's statement is bounded
by the latest bound in it), and a statement that hangs (a table lock taken by DDL, a server that
stopped answering) fails every renewal waiting on it once their bounds have passed, rather than
stalling every lease. A connection that broke is terminated; one a renewal timed out on is
closed once asyncpg has had the server cancel the statement (so it cannot land later). The
next renewal opens another (one attempt at a time, bounded by `CONNECT_SECONDS`; after a failed
one, none for `RETRY_SECONDS`), waiting for it half its bound at most. A renewal that finds no
connection to be had (the attempt failed or is still under way, the pool's arguments cannot be
read, the store closed) runs on the pool as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import StoreError
from .convert import (
    _Q,
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
#: The most renewals one statement sends. Measured on loopback (a shared 2-core machine), a
#: batch of 1,000 runs in about 25 ms (25 us a renewal; 100 take 3.6 ms, one alone 0.8 ms):
#: past a few hundred the round trip no longer counts, so larger batches gain little, while
#: every renewal in one waits for all of it within its own bound (a third of its lease: 5 s
#: for leases of 15 s and more, 33 ms for the shortest, 0.1 s), and one failure (a connection
#: lost, a statement cancelled at its bound) fails all of them. More wait for the next turn.
BATCH = 1000
#: The longest lease a batch takes: the server refuses an interval out of its range, and a
#: statement refused fails every renewal in it, so a lease past this (or NaN) goes alone, as
#: before. (Nothing else in a renewal can be refused: its key and generation are its claim's.)
BATCH_LEASE = 1e9

#: A waiting renewal's answer: renew on the pool (no connection of their own to be had).
_POOL: Any = object()


def bound(lease_seconds: float) -> float:
    """How long a renewal of a lease of `lease_seconds` may take: a third of it (the pause
    between two renewals), at most `RENEW_SECONDS`."""
    return min(lease_seconds / 3, RENEW_SECONDS)


class _Waiting:
    """A renewal waiting for a turn: its `heartbeat` arguments, its answer, and its bound and
    patience on the loop's clock (see `Renewals.fetchval`)."""

    __slots__ = ("args", "deadline", "future", "patience")

    def __init__(
        self, args: tuple[Any, ...], future: asyncio.Future[Any], now: float, seconds: float
    ):
        self.args = args
        self.future = future
        self.deadline = now + seconds
        self.patience = now + seconds / 2


def _own(error: BaseException) -> BaseException:
    """A copy of a batch's error for one of its renewals: one instance raised in many tasks
    grows one traceback."""
    try:
        return copy.copy(error)
    except Exception:
        return StoreError(f"a lease renewal failed: {error!r}")


def _answer(batch: list[_Waiting], answers: list[Any]) -> None:
    for one, answer in zip(batch, answers, strict=True):
        if not one.future.done():  # (past its bound, or cancelled: nobody waits for it)
            one.future.set_result(answer)


class Renewals:
    """One dedicated connection for a store's lease renewals, shared in turns."""

    __slots__ = (
        "_conn",
        "_connect",
        "_draining",
        "_fallback",
        "_opening",
        "_retiring",
        "_retry_at",
        "_stopped",
        "_turns",
        "_waiting",
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
        #: Renewals waiting for the next turn, and the task that sends them (see `_drain`).
        self._waiting: deque[_Waiting] = deque()
        self._draining: asyncio.Task[None] | None = None

    def resume(self) -> None:
        self._stopped = False

    async def renew(self, seconds: float, *args: Any) -> Any:
        """queries.sql `heartbeat`'s answer for `args` (tenant, operation, key, generation,
        lease), within `seconds`: StoreError past them. Alone when the connection is free,
        else in the next turn's batch."""
        if (self._waiting or self._turns().locked()) and -BATCH_LEASE <= args[4] <= BATCH_LEASE:
            return await self._wait(seconds, args)
        return await self.fetchval(seconds, _Q["heartbeat"], *args)

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
                        return await self._run(conn, "fetchval", query, args, patience)
                    conn = await self._opened(patience)
                    if conn is not None:
                        return await self._run(conn, "fetchval", query, args, None)
                return await self._fallback("fetchval", query, *args)
        except TimeoutError:
            raise StoreError(f"a lease renewal took more than {seconds:g} s") from None

    async def _wait(self, seconds: float, args: tuple[Any, ...]) -> Any:
        """`renew` in the next turn's batch: waits for its answer at most `seconds` (its
        batch goes on without it past them)."""
        loop = asyncio.get_running_loop()
        draining = self._draining
        if draining is not None and draining.get_loop() is not loop:
            # (Another event loop's, which ended without cancelling it: its renewals are gone.)
            self._waiting.clear()
            draining = self._draining = None
        waiting = _Waiting(args, loop.create_future(), loop.time(), seconds)
        self._waiting.append(waiting)
        if draining is None:
            self._draining = loop.create_task(self._drain())
        try:
            async with asyncio.timeout_at(waiting.deadline):
                answer = await waiting.future  # (cancelled past its bound: left out, or ignored)
                if answer is _POOL:
                    return await self._fallback("fetchval", _Q["heartbeat"], *args)
        except TimeoutError:
            raise StoreError(f"a lease renewal took more than {seconds:g} s") from None
        if isinstance(answer, BaseException):
            raise _own(answer) from answer.__cause__
        return answer

    async def _drain(self) -> None:
        """Send the waiting renewals, a batch a turn, until none waits."""
        waiting = self._waiting
        try:
            while waiting:
                async with self._turns():
                    batch: list[_Waiting] = []
                    while waiting and len(batch) < BATCH:
                        one = waiting.popleft()
                        if not one.future.done():  # (not past its bound, not cancelled)
                            batch.append(one)
                    if batch:
                        await self._send(batch)
        finally:
            self._draining = None

    async def _send(self, batch: list[_Waiting]) -> None:
        """One statement for `batch`, within the latest bound in it, on the renewals'
        connection; each renewal gets its answer (an error is an answer too), or `_POOL`."""
        if len(batch) == 1:
            method, query, args = "fetchval", _Q["heartbeat"], batch[0].args
        else:
            method, query = "fetch", _Q["heartbeat_batch"]
            args = tuple(list(column) for column in zip(*(one.args for one in batch), strict=True))
        try:
            async with asyncio.timeout_at(max(one.deadline for one in batch)):
                conn = self._conn
                if conn is not None and not conn.is_closed():
                    patience = min(one.patience for one in batch)
                    found = await self._run(conn, method, query, args, patience)
                else:
                    conn = await self._opened(min(one.patience for one in batch))
                    found = (
                        _POOL if conn is None else await self._run(conn, method, query, args, None)
                    )
        except TimeoutError:  # (every bound in it has passed, or is passing)
            _answer(batch, [StoreError("a lease renewal took more than its bound")] * len(batch))
        except Exception as exc:
            _answer(batch, [exc] * len(batch))
        except BaseException:  # (the drain's task cancelled: the loop's end)
            _answer(batch, [StoreError("the lease renewals' batch was cancelled")] * len(batch))
            raise
        else:
            if found is _POOL or method == "fetchval":
                _answer(batch, [found] * len(batch))
            else:
                alive = {row[0]: row[1] for row in found}
                _answer(batch, [alive[n] for n in range(1, len(batch) + 1)])

    async def _run(
        self, conn: Any, method: str, query: str, args: tuple[Any, ...], patience: float | None
    ) -> Any:
        """The statement on `conn`; run once more on a new connection if `conn` turns out to
        be gone and `patience` is given (a connection reused: see `_opened`)."""
        try:
            return await alone(getattr(conn, method), query, *args, on=conn)
        except CONNECTION_ERRORS as exc:
            self._drop(conn)
            # (A connection the server ended while it sat idle is found out by its next
            # statement: that one runs once more, on a new connection.)
            again = None if patience is None else await self._opened(patience)
            if again is None:
                raise translate(exc) from exc
            return await self._run(again, method, query, args, None)
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
