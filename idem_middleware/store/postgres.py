"""The PostgreSQL store (asyncpg). It runs named queries and translates driver errors; the
protocol's decisions live in the middleware."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import orjson

from .. import sql
from ..errors import StoreError
from .base import (
    Claim,
    ClaimTimeout,
    Record,
    RecordKey,
    RetryableConflict,
    State,
    StoredResponse,
    StoreStats,
)

logger = logging.getLogger("idem_middleware.store")

_Q = sql.queries()
# How often a claim re-reads a record that vanished between the INSERT and the SELECT (a
# concurrent claim rolled back, or a purge ran). Each pass makes progress, so a few suffice.
_CLAIM_ATTEMPTS = 4
# A claim told not to wait still needs time to run; asyncpg's timeout covers the whole statement.
_MIN_STATEMENT_TIMEOUT = 0.05

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
)
_ACQUIRE_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *_CONNECTION_ERRORS)
_RETRYABLE: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
)
_WAIT_EXCEEDED: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.QueryCanceledError,
)


def encode_headers(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    # latin-1 maps every byte to one code point, so any header value survives the round trip.
    return orjson.dumps([(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers])


def decode_headers(blob: bytes | None) -> list[tuple[bytes, bytes]]:
    if not blob:
        return []
    return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in orjson.loads(blob)]


def _record(key: RecordKey, row: asyncpg.Record) -> Record:
    status = row["response_status"]
    response = None
    if status is not None:
        response = StoredResponse(
            status=status,
            headers=decode_headers(row["response_headers"]),
            body=row["response_body"] or b"",
            body_omitted=row["body_omitted"],
        )
    return Record(
        key=key,
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        generation=row["generation"],
        response=response,
        expired=bool(row["expired"]),
        lease_expired=bool(row["lease_expired"]),
    )


def _translate(exc: BaseException) -> BaseException:
    if isinstance(exc, _RETRYABLE):
        return RetryableConflict(str(exc))
    if isinstance(exc, _CONNECTION_ERRORS):
        return StoreError(f"{type(exc).__name__}: {exc}")
    return exc


class _PgTransaction:
    """One pooled connection in one transaction (see TransactionSession)."""

    __slots__ = ("_conn", "_tx")

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._tx: Any = None

    @property
    def connection(self) -> Any:
        return self._conn

    @property
    def active(self) -> bool:
        return self._tx is not None

    async def begin(self) -> None:
        tx = self._conn.transaction()
        try:
            await tx.start()
        except _CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        self._tx = tx

    async def commit(self) -> None:
        tx, self._tx = self._tx, None
        try:
            await tx.commit()
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc

    async def rollback(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            try:
                await tx.rollback()
            except _CONNECTION_ERRORS:
                # The connection is gone, and the server rolled the transaction back with it.
                logger.debug("rollback on a lost connection", exc_info=True)

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
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
        conn = self._conn
        try:
            for _ in range(_CLAIM_ATTEMPTS):
                rows = await conn.fetch(_Q["claim"], *args, timeout=timeout)
                if rows:
                    row = rows[0]
                    if row["claimed"]:
                        return Claim(True, row["generation"], None)
                else:
                    # The conflicting claim committed after our snapshot: read it afresh.
                    row = await conn.fetchrow(_Q["get"], *args[:3], timeout=timeout)
                    if row is None:
                        continue
                record = _record(key, row)
                if not record.expired:
                    return Claim(False, record.generation, record)
                generation = await conn.fetchval(_Q["reclaim_expired"], *args, timeout=timeout)
                if generation is not None:
                    return Claim(True, generation, None)
        except _WAIT_EXCEEDED as exc:
            raise ClaimTimeout("waited too long for a concurrent claim") from exc
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc
        raise ClaimTimeout("the record kept changing under the claim")

    async def complete(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        try:
            status = await self._conn.execute(
                _Q["complete"],
                key.tenant,
                key.operation,
                key.key,
                generation,
                state.value,
                response.status,
                encode_headers(response.headers),
                response.body,
                response.body_omitted,
            )
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc
        if status != "UPDATE 1":
            # Our own uncommitted row: only a bug (or a hand edit) makes this miss.
            raise StoreError(f"completion matched no pending record ({status})")


class PostgresStore:
    """The PostgreSQL store. Borrows the caller's asyncpg pool, or creates (and closes) its own.

    For PgBouncer in transaction pooling mode pass `statement_cache_size=0`.
    """

    def __init__(
        self,
        *,
        pool: asyncpg.Pool[Any] | None = None,
        dsn: str | None = None,
        min_size: int = 2,
        max_size: int = 10,
        statement_cache_size: int = 100,
        application_name: str = "idem_middleware",
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if (pool is None) == (dsn is None):
            raise ValueError("pass exactly one of pool= or dsn=")
        self._pool = pool
        self._owns_pool = pool is None
        self._dsn = dsn
        self._pool_kwargs: dict[str, Any] = {
            "min_size": min_size,
            "max_size": max_size,
            "statement_cache_size": statement_cache_size,
            "server_settings": {"application_name": application_name},
            **(connect_kwargs or {}),
        }

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        if self._pool is None:
            raise StoreError("the store is not open: call `await store.open()` first")
        return self._pool

    async def open(self) -> PostgresStore:
        if self._pool is None:
            try:
                self._pool = await asyncpg.create_pool(self._dsn, **self._pool_kwargs)
            except _CONNECTION_ERRORS as exc:
                raise StoreError(f"cannot connect: {exc}") from exc
        return self

    async def close(self) -> None:
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def __aenter__(self) -> PostgresStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def transaction(self, *, acquire_timeout: float) -> AsyncIterator[_PgTransaction]:
        try:
            conn = await self.pool.acquire(timeout=acquire_timeout)
        except _ACQUIRE_ERRORS as exc:
            raise StoreError(f"no database connection: {type(exc).__name__}") from exc
        try:
            session = _PgTransaction(conn)
            await session.begin()
            try:
                yield session
            finally:
                if session.active:
                    await session.rollback()
        finally:
            await self.pool.release(conn)

    async def get(self, key: RecordKey) -> Record | None:
        try:
            row = await self.pool.fetchrow(_Q["get"], key.tenant, key.operation, key.key)
        except _CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        return None if row is None else _record(key, row)

    async def purge(self, *, batch_size: int = 1000, max_batches: int = 1000) -> int:
        """Delete finished records past their retention, one short transaction per batch.

        Never touches pending or unknown records. Returns how many were deleted.
        """
        if batch_size < 1 or max_batches < 1:
            raise ValueError("batch_size and max_batches must be positive")
        deleted = 0
        for _ in range(max_batches):
            try:
                status = await self.pool.execute(_Q["purge_batch"], batch_size)
            except _CONNECTION_ERRORS as exc:
                raise StoreError(str(exc)) from exc
            count = int(status.rsplit(" ", 1)[-1])
            deleted += count
            if count < batch_size:
                break
        return deleted

    async def stats(self) -> StoreStats:
        try:
            rows = await self.pool.fetch(_Q["stats"])
        except _CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        counts = {state.value: 0 for state in State}
        oldest: dict[str, float | None] = {state.value: None for state in State}
        for row in rows:
            counts[row["state"]] = row["count"]
            oldest[row["state"]] = row["oldest_age_seconds"]
        return StoreStats(counts=counts, oldest_age_seconds=oldest)
