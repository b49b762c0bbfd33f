"""The session the store hands out for a transactional claim: one pooled connection and one
transaction. It sends the fused messages when it can (see fused.py) and the ordinary statements
otherwise. Lease mode's fenced transaction is in fenced.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import CoroutineType
from typing import Any, Protocol

from ...delayed import Delayed
from ...errors import ClaimBusy, ClaimTimeout, RetryableConflict, StoreError
from ..base import Claim, Claimed, Existing, RecordKey, State, StoredResponse, lapsed
from . import compat, convert
from .claim import claim, claim_refused, expire_lapsed, lock_key, taken_by_another
from .claim_lock import ClaimLocks
from .convert import (
    _Q,
    CHECKOUT_ERRORS,
    CONNECTION_ERRORS,
    READ_ONLY,
    SERVER_ERROR,
    STALE_STATEMENT,
    TRANSLATED,
    UNIQUE_VIOLATION,
    WAIT_EXCEEDED,
    claim_connection_gone,
    is_conflict,
    no_connection,
    stale_statement,
    translate,
)
from .fused import FastPath
from .refusing import read_only_cause, refused, skipped
from .rows import completion_args, to_record
from .runner import give_back, warn_ended

logger = logging.getLogger("idem_middleware.store")

# A claim told not to wait still needs time to run; asyncpg's timeout covers the whole statement.
_MIN_STATEMENT_TIMEOUT = 0.05
_Refusal = Callable[[BaseException], StoreError]


class Lender(Protocol):
    """What a transaction session needs of its store."""

    _fast: FastPath | None
    _locks: ClaimLocks
    _clean_releases: Any  # (runner.PoolStatements)
    idle_in_transaction: float

    @property
    def pool(self) -> Any: ...

    def _mark_clean(self, conn: Any) -> bool: ...  # ran only our statements: no reset needed


class PgTransaction:
    """One pooled connection, and one transaction that begins with the claim (see
    TransactionSession). On the fast path BEGIN and the claim travel in one message, as do the
    outcome and COMMIT (fused.py).

    A fast claim writes nothing: it takes the key's advisory lock and finds no record; the
    record is written once, with its outcome, at commit (`insert_final`)."""

    __slots__ = (
        "_claimed",
        "_conn",
        "_deadline",
        "_deferred",
        "_expired",
        "_fast",
        "_fused",
        "_lender",
        "_locks",
        "_pool",
        "_task",
        "_tx",
        "lent",
    )

    def __init__(self, lender: Lender, deadline: Delayed) -> None:
        self._lender = lender  # the store: its pool, and which connections need no reset
        self._deadline = deadline  # bounds the waits for the pool: checkout, and return
        self._pool: Any = None  # the pool the connection came from
        self._conn: Any = None  # the pool's proxy: what the handler gets, and what goes back
        self._task: asyncio.Task[Any] | None = None  # while it waits for a connection
        self._expired = False
        self._locks = lender._locks  # the store's: computes each key's claim lock
        self._fast = lender._fast  # None: the fast path is off
        self._tx: Any = None
        self._fused = False  # the claim went the fast way (`fusable`): completion with COMMIT
        # The key and generation this transaction claimed: what `finish` records.
        self._claimed: tuple[RecordKey, int] | None = None
        # (fingerprint, retention seconds) of a claim whose record is written at completion.
        self._deferred: tuple[bytes, float] | None = None
        # Whether the connection was handed out (to the handler): then the pool resets it.
        self.lent = False

    async def __aenter__(self) -> PgTransaction:
        """A connection from the pool, waited for at most the deadline's delay. One timer
        (`Delayed`) serves every session of the store: a timer per checkout, armed and cancelled
        per request (asyncpg's `acquire(timeout=)`), costs more than the rest of the checkout."""
        pool = self._lender.pool
        task = self._task = asyncio.current_task()
        deadline = self._deadline
        deadline.add(self)
        try:
            self._conn = await pool.acquire()
            self._pool = pool  # (set only with a connection: `release` gives back what was had)
        except asyncio.CancelledError:
            if self._expired and task is not None and task.uncancel() == 0:
                raise StoreError("no database connection: TimeoutError") from None
            raise  # cancelled by someone else (a shutdown): that goes on
        except CHECKOUT_ERRORS as exc:
            raise no_connection(exc) from exc
        finally:
            deadline.discard(self)
            self._task = None
        return self

    def __aexit__(self, *exc: object) -> CoroutineType[Any, Any, None]:  # (pyright: see Store)
        return self.release()  # type: ignore[return-value]  # (its coroutine: none wraps it)

    def due(self) -> None:
        """The deadline passed: a checkout still waiting is cancelled (and reports a timeout);
        a connection still on its way back (an unresponsive server) is terminated, which ends
        the rollback or reset it is stuck in (the pool opens a new one when it needs one)."""
        self._expired = True
        if self._task is not None:
            self._task.cancel()
        elif self._conn is not None:
            try:
                self._conn.terminate()
            except CONNECTION_ERRORS:
                return  # given back already (the proxy refuses): nothing is stuck
            logger.warning("a connection did not come back to the pool in time; terminated it")

    @property
    def connection(self) -> Any:
        self.lent = True
        return self._conn

    @property
    def driver(self) -> Any:
        """The connection behind the pool's proxy, for the store's own statements (each call
        through the proxy is a Python function of asyncpg's more). Read from the proxy each time,
        never kept: once the proxy is given back (by the session, or by a handler that had it)
        this is None, and nothing of ours can reach the connection's next owner."""
        return compat.raw_connection(self._conn)

    def conflict(self, exc: BaseException) -> bool:
        if stale_statement(exc):  # (through SQLAlchemy's errors, or a task group, too)
            # One of asyncpg's statements was dropped (a handler ran DEALLOCATE ALL): the
            # attempt runs again with the connection's cache emptied.
            compat.forget_statements(self._conn)
        return is_conflict(exc)

    def lost(self) -> StoreError | None:
        if self._pool is None:
            return None  # released by us (a stream's, settled before its first byte)
        raw = self.driver  # (None: asyncpg detached the handler's proxy when it was lost)
        if raw is not None and not raw.is_closed():
            return None
        return StoreError(self._gone())

    def _gone(self) -> str:
        return claim_connection_gone(self._lender.idle_in_transaction)

    def fusing(self, conn: Any, *, begins: bool) -> None:
        if begins:
            self._tx = compat.adopt(conn)
        self._fused = True

    async def begin(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - the claim's
        """BEGIN the ordinary way; the claim does, within its wait (a server that stopped
        answering held the request as long), and says a TimeoutError (tests may begin first)."""
        tx = self.driver.transaction()
        try:
            async with asyncio.timeout(timeout):
                await tx.start()
        except CONNECTION_ERRORS as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise StoreError(str(exc)) from exc
        self._tx, self._fused, self._deferred = tx, False, None

    async def release(self) -> None:
        """End the session, early (a response that streams) or at the block's end: the
        connection goes back to the pool it came from, even if the store was closed meanwhile
        (a shutdown with requests in flight: the pool's close waits for it). Once."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        conn = self._conn
        deadline = self._deadline
        self._expired = False
        deadline.add(self)
        try:
            try:
                if self._tx is not None:
                    await self.rollback()
                if not self.lent:
                    self._lender._mark_clean(conn)  # a replay, say: the handler never had it
            finally:
                await give_back(pool, conn, self._lender._clean_releases)  # even if cancelled
        finally:
            deadline.discard(self)

    async def _commit(self) -> None:
        tx, self._tx = self._tx, None
        try:
            await tx.commit()
        except TRANSLATED as exc:
            raise translate(exc) from exc
        except convert.SERVER_ERROR as exc:  # a deferred constraint of the handler's writes
            raise refused(exc, at_commit=True) from exc

    async def abandon(self) -> None:
        await self.rollback()

    async def rollback(self) -> None:
        tx, self._tx = self._tx, None
        self._deferred = None
        self._claimed = None
        if tx is not None:
            try:
                await tx.rollback()
            except CONNECTION_ERRORS:
                # The connection is gone, and the server rolled the transaction back with it.
                logger.debug("rollback on a lost connection", exc_info=True)

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        args = (key, fingerprint, retention_seconds, wait_seconds, token_hash)
        try:
            result = await self._claim(*args)
        except StoreError as exc:
            # (A TimeoutError is an OSError: the wait ran out, and no connection was lost.)
            lost = isinstance(exc.__cause__, CONNECTION_ERRORS)
            if self._claimed is not None or not lost or isinstance(exc.__cause__, TimeoutError):
                raise
            # The server ended the connection while it sat in the pool (`idle_session_timeout`,
            # a restart) and the claim's statement found out: nothing of this transaction was
            # done, so it is claimed once more, on another connection.
            logger.info("the claim's connection was gone (%s); claiming on another", exc)
            self._tx, self._fused, self._deferred = None, False, None
            await self.release()  # (a connection found gone goes back: the pool drops it)
            await self.__aenter__()
            result = await self._claim(*args)
        if isinstance(result, Claimed):
            self._claimed = (key, result.generation)
        elif self._claimed is None:
            await self.rollback()  # nothing claimed: the transaction has nothing to keep
            if isinstance(result, Existing) and lapsed(result.record, fingerprint):
                result = await expire_lapsed(self.driver, result.record, wait_seconds)
        return result

    async def _claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None,
    ) -> Claim:
        timeout = max(wait_seconds, _MIN_STATEMENT_TIMEOUT)
        try:
            locks = self._locks
            if not locks.loaded:
                await locks.load(self.driver)  # the store's `open` could not reach the server
            lock = locks.of(key)
            if self._tx is None:
                if self._fast is not None and token_hash is None:
                    claimed = await self._fast.begin_and_claim(self, key, lock, timeout)
                    if claimed is not None:
                        self._deferred = (fingerprint, retention_seconds)
                        return claimed
                if self._tx is None:
                    await self.begin(timeout)
                else:
                    # The key is taken (a replay, most likely): read the record. `claim`
                    # decides the rarer cases (it expired, or vanished since).
                    row = await self.driver.fetchrow(
                        _Q["get"], key.tenant, key.operation, key.key, timeout=timeout
                    )
                    if row is not None:
                        record = to_record(key, row)
                        if not (record.expired or record.retry_allowed):
                            return Existing(record)
            elif self._deferred is not None and self._claimed is not None:
                # (A second claim after a fast one: the first's deferred record is written now.)
                (k, g), (f, s), self._deferred = self._claimed, self._deferred, None
                await self.driver.execute(_Q["write_deferred"], *k, f, g, s, timeout=timeout)
            await lock_key(self.driver, key, lock, timeout)
            # (The ordinary claim's arguments: built here, where the fast claim returned already.)
            args = (*key, fingerprint, "transactional", retention_seconds, None)
            try:
                # (The lock again: `_lock_key` takes none when it sees a live record, which may
                # be gone by now; advisory locks nest, so one taken there is taken again.)
                return await claim(self.driver, key, args, token_hash, timeout, lock)
            except WAIT_EXCEEDED as exc:
                raise ClaimTimeout("waited too long for a concurrent claim") from exc
        except ClaimBusy:
            await self.rollback()
            raise
        except STALE_STATEMENT as exc:
            raise await self._stale(exc) from exc
        except UNIQUE_VIOLATION as exc:  # (`write_deferred`'s record, or another constraint's)
            raise await self._lost_or_refused(exc, claim_refused) from exc
        except WAIT_EXCEEDED as exc:
            # Only `claim` waits for a lock (a concurrent claim's row). Out of time elsewhere,
            # it waited for the server (a pooler, a table locked by DDL): the store's trouble.
            raise StoreError("the database did not answer the claim in time") from exc
        except TRANSLATED as exc:
            raise translate(exc) from exc
        except SERVER_ERROR as exc:
            raise claim_refused(exc) from exc

    async def finish(self, state: State, response: StoredResponse) -> None:
        if self._claimed is None:
            raise StoreError("finish without a claim")
        key, generation = self._claimed
        name, args = completion_args(key, generation, state, response, self._deferred)
        fast = self._fast
        # The handler had the proxy and may have given it back to the pool: then `driver` is None
        # and the proxy's own call below reports it (sent past it, the completion would commit
        # outside the claim's transaction, rolled back by the pool, or inside the next owner's).
        raw = self.driver
        if raw is not None and not raw.is_in_transaction():
            warn_ended(key, "the claim's")
        if self._fused and fast is not None and raw is not None:
            try:
                done = await fast.complete_and_commit(raw, self._tx, name, args, len(response.body))
            except (UNIQUE_VIOLATION, READ_ONLY) as exc:  # (the record's, the handler's, ...)
                raise await self._lost_or_refused(exc, refused) from exc
            except STALE_STATEMENT as exc:
                raise await self._stale(exc) from exc
            except TRANSLATED as exc:
                raise translate(exc) from exc
            except convert.SERVER_ERROR as exc:
                raise refused(exc, at_commit=not raw.is_in_transaction()) from exc
            if done:
                self._done()
                return
        query = _Q["insert_final"] if name == "insert_final" else _Q["complete"]
        try:
            status = await self._conn.execute(query, *args)  # (the proxy: see above)
        except (UNIQUE_VIOLATION, READ_ONLY) as exc:
            raise await self._lost_or_refused(exc, refused) from exc
        except STALE_STATEMENT as exc:
            raise await self._stale(exc) from exc
        except TRANSLATED as exc:
            if raw is None:  # (asyncpg says "released back to the pool" of a lost one too)
                raise StoreError(self._gone()) from exc
            raise translate(exc) from exc
        except convert.SERVER_ERROR as exc:
            raise refused(exc) from exc
        if status not in ("UPDATE 1", "INSERT 0 1"):  # (our own uncommitted row, or none)
            raise skipped(f"the completion matched no pending record ({status})")
        await self._commit()
        self._done()

    def _done(self) -> None:
        self._tx = None
        self._deferred = None
        self._claimed = None

    async def _lost_or_refused(self, exc: BaseException, refusal: _Refusal) -> BaseException:
        """The completion (or its COMMIT) refused for a unique violation or as read-only, and
        rolled back: the attempt runs again when another claim took the key (`taken_by_another`),
        else `refusal` names the constraint; read-only, `read_only_cause` says whose doing."""
        convert.scrub(exc)
        claimed = self._claimed[0] if self._claimed is not None else None
        await self.rollback()
        if isinstance(exc, READ_ONLY):
            return await read_only_cause(self.driver, exc)
        if claimed is None or not await taken_by_another(self.driver, claimed):
            return refusal(exc)
        logger.debug("the key was recorded by another claim first", exc_info=exc)
        return RetryableConflict("the key was recorded by a concurrent claim")

    async def _stale(self, exc: BaseException) -> RetryableConflict:
        """A statement the session had prepared is gone (the handler, or one before it on this
        connection, ran DEALLOCATE ALL): it did not run, and the transaction is over. The
        connection's cache is emptied and the attempt runs again (nothing of it committed)."""
        logger.warning("a prepared statement was dropped from the claim's session; running again")
        compat.forget_statements(self._conn)
        await self.rollback()
        return RetryableConflict(f"a prepared statement was dropped from the session: {exc}")
