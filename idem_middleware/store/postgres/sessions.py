"""The sessions the store hands out: one transaction for a transactional claim, and a fenced
transaction for lease mode's writes. Each sends the fused messages when it can (see fused.py)
and the ordinary statements otherwise."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import ClaimBusy, ClaimTimeout, RetryableConflict, StoreError
from ..base import Claim, Claimed, Existing, RecordKey, Settlement, State, StoredResponse
from . import compat
from .claim import claim
from .claim_lock import ClaimLocks
from .convert import (
    _Q,
    CONNECTION_ERRORS,
    TRANSLATED,
    UNIQUE_VIOLATION,
    WAIT_EXCEEDED,
    encode_headers,
    is_conflict,
    settle_args,
    to_record,
    translate,
)
from .fused import FastPath

logger = logging.getLogger("idem_middleware.store")

# A claim told not to wait still needs time to run; asyncpg's timeout covers the whole statement.
_MIN_STATEMENT_TIMEOUT = 0.05


class PgTransaction:
    """One pooled connection, and one transaction that begins with the claim (see
    TransactionSession). On the fast path BEGIN and the claim travel in one message, as do the
    outcome and COMMIT (fused.py).

    A fast claim writes nothing: it takes the key's advisory lock and checks that no record
    holds the key, and the record is written once, with its outcome, at commit (`insert_final`).
    A pending transactional record is never visible to anyone else anyway, so writing it early
    only cost an UPDATE, a dead row version and its index entries."""

    __slots__ = (
        "_claimed",
        "_conn",
        "_deferred",
        "_fast",
        "_fused",
        "_give_back",
        "_locks",
        "_pool",
        "_tx",
        "lent",
    )

    def __init__(self, conn: Any, fast: FastPath | None, locks: ClaimLocks) -> None:
        self._conn = conn
        self._locks = locks  # the store's: computes each key's claim lock
        # Set by the store: ends the session and returns the connection to the pool (once).
        self._give_back: Callable[[PgTransaction, Any, Any], Awaitable[None]] | None = None
        self._pool: Any = None  # the pool the connection came from
        self._fast = fast  # None: the fast path is off
        self._tx: Any = None
        # Whether the claim went the fast way (the connection passed `fusable`), so the
        # completion may travel with the COMMIT too.
        self._fused = False
        # The key and generation this transaction claimed: what `finish` records.
        self._claimed: tuple[RecordKey, int] | None = None
        # (fingerprint, retention seconds) of a claim whose record is written at completion.
        self._deferred: tuple[bytes, float] | None = None
        # Whether the connection was handed out (to the handler): then the pool resets it.
        self.lent = False

    @property
    def connection(self) -> Any:
        self.lent = True
        return self._conn

    @property
    def driver(self) -> Any:
        return self._conn

    @property
    def active(self) -> bool:
        return self._tx is not None

    def conflict(self, exc: BaseException) -> bool:
        return is_conflict(exc)

    def fusing(self, *, begins: bool) -> None:
        if begins:
            self._tx = compat.adopt(self._conn)
        self._fused = True

    async def begin(self) -> None:
        """BEGIN the ordinary way (the claim does this; tests may begin before the claim)."""
        tx = self._conn.transaction()
        try:
            await tx.start()
        except CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        self._tx = tx
        self._fused = False
        self._deferred = None

    async def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            await give_back(self, self._conn, self._pool)

    async def _commit(self) -> None:
        tx, self._tx = self._tx, None
        try:
            await tx.commit()
        except TRANSLATED as exc:
            raise translate(exc) from exc

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
        result = await self._claim(key, fingerprint, retention_seconds, wait_seconds, token_hash)
        if isinstance(result, Claimed):
            self._claimed = (key, result.generation)
        elif self._claimed is None:
            await self.rollback()  # nothing claimed: the transaction has nothing to keep
        return result

    async def _claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None,
    ) -> Claim:
        args = (
            key.tenant,
            key.operation,
            key.key,
            fingerprint,
            "transactional",
            retention_seconds,
            None,
        )
        timeout = max(wait_seconds, _MIN_STATEMENT_TIMEOUT)
        try:
            locks = self._locks
            if not locks.loaded:
                await locks.load(self._conn)  # the store's `open` could not reach the server
            lock = locks.of(key)
            if self._tx is None:
                if self._fast is not None and token_hash is None:
                    claimed = await self._fast.begin_and_claim(self, key, lock, timeout)
                    if claimed is not None:
                        self._deferred = (fingerprint, retention_seconds)
                        return claimed
                if self._tx is None:
                    await self.begin()
                else:
                    # The key is taken (a replay, most likely): read the record. `claim`
                    # decides the rarer cases (it expired, or vanished since).
                    row = await self._conn.fetchrow(_Q["get"], *args[:3], timeout=timeout)
                    if row is not None:
                        record = to_record(key, row)
                        if not record.expired:
                            return Existing(record)
            await self._lock_key(key, lock, timeout)
            return await claim(self._conn, key, args, token_hash, timeout)
        except ClaimBusy:
            await self.rollback()
            raise
        except WAIT_EXCEEDED as exc:
            raise ClaimTimeout("waited too long for a concurrent claim") from exc
        except TRANSLATED as exc:
            raise translate(exc) from exc

    async def _lock_key(
        self,
        key: RecordKey,
        lock: int,
        timeout: float,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
    ) -> None:
        """The ordinary path's claim takes the key's advisory lock too (without waiting), so
        its INSERT never queues behind another transaction's uncommitted claim of the key. (A
        lock this transaction holds already is taken again: advisory locks nest.)"""
        found = await self._conn.fetchval(
            _Q["claim_key_count"], key.tenant, key.operation, key.key, lock, timeout=timeout
        )
        if found == 2:
            raise ClaimBusy("another transaction is claiming this key")

    async def finish(self, state: State, response: StoredResponse) -> None:
        if self._claimed is None:
            raise StoreError("finish without a claim")
        key, generation = self._claimed
        name, args = self._completion(key, generation, state, response)
        fast = self._fast
        if self._fused and fast is not None:
            try:
                done = await fast.complete_and_commit(
                    self._conn, self._tx, name, args, len(response.body)
                )
            except UNIQUE_VIOLATION as exc:
                raise await self._lost_the_key(exc) from exc
            except TRANSLATED as exc:
                raise translate(exc) from exc
            if done:
                self._done()
                return
        query = _Q["insert_final"] if name == "insert_final" else _Q["complete"]
        try:
            status = await self._conn.execute(query, *args)
        except UNIQUE_VIOLATION as exc:
            raise await self._lost_the_key(exc) from exc
        except TRANSLATED as exc:
            raise translate(exc) from exc
        if status not in ("UPDATE 1", "INSERT 0 1"):
            # Our own uncommitted row: only a bug (or a hand edit) makes this miss.
            raise StoreError(f"completion matched no pending record ({status})")
        await self._commit()
        self._done()

    def _done(self) -> None:
        self._tx = None
        self._deferred = None
        self._claimed = None

    def _completion(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> tuple[str, tuple[Any, ...]]:
        """The completing statement and its arguments: the pending record's UPDATE
        (`complete`), or, for a claim that wrote nothing yet, the record's one INSERT."""
        headers = encode_headers(response.headers)
        if self._deferred is None:
            return "complete", (
                key.tenant,
                key.operation,
                key.key,
                generation,
                state.value,
                response.status,
                headers,
                response.body,
                response.body_omitted,
            )
        fingerprint, retention_seconds = self._deferred
        return "insert_final", (
            key.tenant,
            key.operation,
            key.key,
            fingerprint,
            generation,
            retention_seconds,
            state.value,
            response.status,
            headers,
            response.body,
            response.body_omitted,
        )

    async def _lost_the_key(self, exc: BaseException) -> RetryableConflict:
        """A record for the key appeared while the handler ran: a claim that took no advisory
        lock (the ordinary path, a token claim, or a lease-mode claim of the same operation)
        committed it first. Nothing of ours is committed; the attempt runs again, and its
        claim finds that record."""
        logger.debug("the key was recorded by another claim first", exc_info=exc)
        await self.rollback()
        return RetryableConflict("the key was recorded by a concurrent claim")


class PgFenced:
    __slots__ = ("_conn", "_expected", "_fast", "_generation", "_key", "_tx", "committed")

    def __init__(
        self,
        conn: Any,
        tx: Any,
        fast: FastPath | None,
        key: RecordKey,
        generation: int,
        expected: State,
    ) -> None:
        self._conn = conn
        self._tx = tx
        self._fast = fast  # set when the fence was opened the fast way (an adopted BEGIN)
        self._key = key
        self._generation = generation
        self._expected = expected
        self.committed = False

    @property
    def connection(self) -> Any:
        return self._conn

    async def settle(self, s: Settlement) -> bool:
        args = settle_args(self._key, self._generation, self._expected, s)
        if self._fast is not None:
            body = b"" if s.response is None else s.response.body
            try:
                done = await self._fast.settle_and_commit(self._conn, self._tx, args, len(body))
            except TRANSLATED as exc:
                raise translate(exc) from exc
            if done:
                self.committed = True
                return True
        try:
            row = await self._conn.fetchrow(_Q["settle"], *args)
            if not row["settled"]:
                return False  # the session's end rolls back
            await self._tx.commit()
        except TRANSLATED as exc:
            raise translate(exc) from exc
        self.committed = True
        return True
