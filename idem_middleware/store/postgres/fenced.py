"""Lease mode's fenced transaction: the handler's writes, committed with the settlement of the
generation that fenced the record (in one message on the fast path, see fused.py)."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from ...delayed import Delayed
from ...errors import ClaimBusy, StaleGeneration, StoreError
from ..base import RecordKey, Settlement, State
from . import compat
from .convert import (
    _Q,
    CHECKOUT_ERRORS,
    CONNECTION_ERRORS,
    LOCK_NOT_AVAILABLE,
    READ_ONLY,
    RETRYABLE,
    SERVER_ERROR,
    STALE_STATEMENT,
    TRANSLATED,
    lock_waited,
    no_connection,
    reports_lost,
    translate,
)
from .fused import FastPath
from .refusing import refused, skipped
from .rows import settle_args
from .runner import Bounded, alone, discard, give_back, warn_ended

logger = logging.getLogger("idem_middleware.store")


def _refused(exc: BaseException) -> StoreError:
    """A fenced transaction the server refused at its settlement (a serialization failure or a
    deadlock: under SERIALIZABLE, concurrent ones meet on `idem_requests`' index pages). It
    cannot be run again (the handler ran, its downstream call was made): its outcome is not
    recorded, as when the connection is lost, and the client is answered 503 (was a plain 500).
    The record stays pending until its lease lapses."""
    return StoreError(f"the fenced transaction was refused at its settlement: {exc}")


class Fencing(Bounded):
    """`PostgresStore.fenced(...)`: a connection from the pool, BEGIN and the record locked under
    the generation (StaleGeneration if it no longer holds it), then the session (this object
    again: one object per fence, not a context manager and a session); at the end a commit
    (unless the session committed with its settlement), a rollback if the block raised, and the
    connection back to the pool. A class, not a generator's context manager: that one's
    machinery cost more than the fence's own work, once per lease request."""

    __slots__ = (
        "_adopted",
        "_clean",
        "_deadline",
        "_expected",
        "_fast",
        "_generation",
        "_key",
        "_pool",
        "_tx",
        "committed",
        "connection",
    )

    def __init__(
        self,
        pool: Any,
        deadline: Delayed,
        fast: FastPath | None,
        key: RecordKey,
        generation: int,
        expected: State,
        clean: weakref.WeakSet[Any] | None = None,
    ) -> None:
        Bounded.__init__(self)
        self._pool = pool
        self._clean = clean  # the store's clean connections, if its reset skips them
        self._deadline = deadline  # bounds the wait for the pool (see runner.Bounded)
        self._fast = fast  # None: the fast path is off
        self._key = key
        self._generation = generation
        self._expected = expected
        #: The session's connection (the pool's proxy) once entered, until it goes back.
        self.connection: Any = None
        self._tx: Any = None
        self._adopted: FastPath | None = None  # set when opened the fast way (an adopted BEGIN)
        self.committed = False

    async def __aenter__(self) -> Fencing:
        deadline = self._deadline
        self.task = asyncio.current_task()
        deadline.add(self)
        try:
            conn = await self._pool.acquire()
        except asyncio.CancelledError:
            if self.timed_out():
                raise StoreError("no database connection: TimeoutError") from None
            raise
        except CHECKOUT_ERRORS as exc:
            raise no_connection(exc) from exc
        finally:
            deadline.discard(self)
            self.task = None
        try:
            try:
                # BEGIN and the lock, again while the server refuses the lock for a
                # serialization failure: under REPEATABLE READ or SERIALIZABLE (a database's or
                # role's default) it fails when a heartbeat committed a newer version of the row
                # after the transaction's snapshot. The lock is the transaction's first
                # statement, so nothing was done yet: `_open_once` rolled it back, and a new
                # transaction with a new snapshot tries again (`runner.alone`). (Called here,
                # not from a coroutine of its own: one frame fewer on every lease request.)
                tx, held, fast = await alone(self._open_once, conn, on=conn)
            except TRANSLATED as exc:
                raise translate(exc) from exc
            if not held:
                await _roll_back(tx, conn)
                raise StaleGeneration(
                    f"generation {self._generation} no longer holds the record; its writes are "
                    "refused"
                )
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                # Cancelled in its lock wait (a bound on the wait for another session's fence,
                # a client gone): the pool's reset would find the transaction open and log an
                # ERROR for it. Terminated instead: a new connection is opened when needed.
                discard(conn)
            await give_back(self._pool, conn)
            raise
        self.connection = conn
        self._tx = tx
        self._adopted = fast
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        conn, self.connection = self.connection, None
        assert conn is not None
        try:
            if not self.committed:
                if exc_type is not None:
                    await _roll_back(self._tx, conn)
                else:
                    try:
                        await self._tx.commit()
                    except TRANSLATED as error:
                        raise translate(error) from error
        finally:
            await give_back(self._pool, conn, self._clean)

    def lost(self, error: BaseException) -> bool:
        """Whether `error` (the handler's) is the driver's report of the fenced transaction's
        connection gone (closed, or given back by asyncpg when it closed: the server, or a
        pooler in between, ended the session), raised by the handler's next fenced statement
        or wrapped by it (an ORM's error, `raise ... from`). A handler's own error stands."""
        raw = compat.raw_connection(self.connection)
        if raw is not None and not raw.is_closed():
            return False
        return reports_lost(error)  # (through a task group's errors too)

    async def settle(self, s: Settlement) -> bool:
        args = settle_args(self._key, self._generation, self._expected, s)
        # The connection behind the pool's proxy (each call through the proxy is a Python
        # function more); None once given back, when the ordinary path below reports it.
        raw = compat.raw_connection(self.connection)
        if raw is not None and not raw.is_in_transaction():
            warn_ended(self._key, "the fenced")
        if self._adopted is not None and raw is not None:
            body = b"" if s.response is None else s.response.body
            try:
                done = await self._adopted.settle_and_commit(raw, self._tx, args, len(body))
            except RETRYABLE as exc:
                raise _refused(exc) from exc
            except READ_ONLY as exc:  # (the fence locked a row: the handler made it read-only)
                raise refused(exc, fenced=True) from exc
            except TRANSLATED as exc:
                raise translate(exc) from exc
            except STALE_STATEMENT:
                raise
            except SERVER_ERROR as exc:  # what the handler did: an aborted transaction, say
                raise refused(exc, True, at_commit=not raw.is_in_transaction()) from exc
            if done:
                self.committed = True
                return True
        try:
            row = await self.connection.fetchrow(_Q["settle"], *args)
            if not row["settled"]:  # (under its own lock: a trigger or rule skipped it)
                raise skipped("the fenced settlement matched nothing under its own lock", True)
            await self._tx.commit()
        except RETRYABLE as exc:
            raise _refused(exc) from exc
        except STALE_STATEMENT:
            compat.forget_statements(
                self.connection
            )  # (the handler dropped them): for whoever is next
            raise
        except READ_ONLY as exc:
            raise refused(exc, fenced=True) from exc
        except TRANSLATED as exc:
            raise translate(exc) from exc
        except SERVER_ERROR as exc:
            at_commit = not self.connection.is_in_transaction()
            raise refused(exc, True, at_commit=at_commit) from exc
        self.committed = True
        return True

    async def _open_once(self, conn: Any) -> tuple[Any, bool, FastPath | None]:
        """BEGIN and lock the record under the generation: (transaction, held, fast). The fast
        way sends both in one message; its status line says whether the row was locked. On a
        serialization failure the transaction is rolled back before it is raised."""
        key = self._key
        args = (key.tenant, key.operation, key.key, self._generation, str(self._expected))
        # A reconciler's fence (an unknown record) never waits for another session's lock on
        # the row (another reconciler asking its downstream system): ClaimBusy at once
        # (`fence_nowait`). An executor's waits; a wait the server's `lock_timeout` cancels is
        # rolled back and answered 503 (`lock_waited`; it was a plain 500).
        nowait = self._expected is State.UNKNOWN
        if self._fast is not None and not nowait:
            try:
                opened = await self._fast.open_fence(compat.raw_connection(conn), args)
            except LOCK_NOT_AVAILABLE as exc:
                raise lock_waited(exc) from exc
            if opened is not None:
                return (*opened, self._fast)
        tx = conn.transaction()
        await tx.start()
        try:
            held = await conn.fetchval(_Q["fence_nowait"] if nowait else _Q["fence"], *args)
        except (*RETRYABLE, STALE_STATEMENT):
            await tx.rollback()  # (`alone` runs it again)
            raise
        except LOCK_NOT_AVAILABLE as exc:
            await tx.rollback()
            if nowait:
                raise ClaimBusy("another session holds the record") from exc
            raise lock_waited(exc) from exc
        return tx, held is not None, None


async def _roll_back(tx: Any, conn: Any) -> None:
    """Roll the fenced transaction back. On a lost connection the server rolled it back already:
    the connection is terminated (its release then sends nothing to a dead connection) and the
    error that ended the block, if any, is the one that stands."""
    try:
        await tx.rollback()
    except CONNECTION_ERRORS:
        logger.debug("rollback on a lost connection", exc_info=True)
        discard(conn)
