"""SQLAlchemy 2.0 `AsyncSession`s that run inside the claim's transaction.

A session made here writes on the connection that holds the request's claim (transactional
mode) or its fenced transaction (lease mode): its writes commit with the outcome and roll back
with it. The session's own transaction is a savepoint inside that transaction (asyncpg nests a
`connection.transaction()` opened inside another as a SAVEPOINT), so

- `session.commit()` flushes and releases the savepoint: nothing reaches the database for good
  until the outcome commits, and a later failure still rolls it back;
- `session.rollback()` undoes the session's writes since its last commit, and the claim stays;
- `session.close()` never closes the connection: the store owns it.

The engine is made once per `ClaimSessions`; every checkout hands out the connection of the claim
running in the current task (see `current_context`), wrapped once per connection so SQLAlchemy's
prepared-statement cache survives between requests. Install with the `[sqlalchemy]` extra.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any

from sqlalchemy import util as _sa_util
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql import json as _pg_json
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine
from sqlalchemy.pool import Pool
from starlette.requests import Request

from .context import current_context, get_context
from .errors import ConfigurationError
from .store.postgres.compat import prepare_cached, raw_connection

if TYPE_CHECKING:
    from sqlalchemy.pool import ConnectionPoolEntry

__all__ = [
    "ClaimSession",
    "ClaimSessions",
    "claim_engine",
    "claim_session",
    "open_claim_session",
]

# `await_only` is the name SQLAlchemy 2.0 exports; 2.1 calls it `await_` (the old name goes in 2.2).
_await: Any = getattr(_sa_util, "await_", None) or _sa_util.await_only

# The driver connection a checkout is creating a DBAPI wrapper for (read by `_creator`).
_connecting: ContextVar[Any] = ContextVar("idem_middleware_sqla_connecting", default=None)


def _driver_connection(connection: Any) -> Any:
    # A pool hands out a proxy per acquisition (and `_Statements` wraps the connection behind
    # one): the adapter is kept per real connection.
    if isinstance(connection, _Statements):
        return connection.driver
    return raw_connection(connection) or connection


class ClaimDialect(PGDialect_asyncpg):
    """asyncpg, without installing SQLAlchemy's JSON codecs on the store's connections.

    The stock dialect registers json/jsonb codecs on every connection it opens; here the
    connections belong to the store's pool, where the outbox and raw-asyncpg handlers expect
    asyncpg's own (text) decoding. SQLAlchemy parses JSON itself instead.
    """

    supports_statement_cache = True
    supports_native_json_deserialization = False  # SQLAlchemy 2.1: parse results in Python
    # SQLAlchemy 2.0 marks the same thing with asyncpg-specific JSON types: use the plain ones.
    colspecs = {  # noqa: RUF012 - the base class declares it
        generic: (
            _pg_json.JSONB
            if getattr(impl, "__name__", "") == "AsyncpgJSONB"
            else _pg_json.JSON
            if getattr(impl, "__name__", "") == "AsyncpgJSON"
            else impl
        )
        for generic, impl in PGDialect_asyncpg.colspecs.items()
    }

    async def setup_asyncpg_json_codec(self, conn: Any) -> None:
        return None

    async def setup_asyncpg_jsonb_codec(self, conn: Any) -> None:
        return None


registry.register("postgresql.idem_claim", __name__, "ClaimDialect")


class ClaimPool(Pool):
    """Hands out the current claim's connection; never opens or closes one of its own."""

    _is_asyncio = True

    def __init__(self, creator: Any, **kw: Any) -> None:
        super().__init__(creator, **kw)
        self._records: dict[Any, ConnectionPoolEntry] = {}  # driver connection -> its entry
        self._out: set[Any] = set()  # driver connections checked out right now

    def _do_get(self) -> ConnectionPoolEntry:
        context = current_context()
        if context is None:
            raise RuntimeError(
                "no idempotency claim is running in this task: a claim session works only "
                "inside a guarded request (or an idempotent job)"
            )
        connection = _await(context.fenced_connection())
        if connection is None:
            raise ConfigurationError(
                "this claim has no database connection: SQLAlchemy sessions need PostgresStore"
            )
        driver = _driver_connection(connection)
        if driver in self._out:
            raise RuntimeError(
                "the claim's connection is already in use by another SQLAlchemy connection: "
                "use one session per request (a FastAPI dependency gives every dependant the "
                "same one)"
            )
        record = self._records.get(driver)
        if record is None or record.dbapi_connection is None:
            # A connection the pool has not seen: forget the closed ones first.
            for old in [c for c in self._records if c.is_closed()]:
                del self._records[old]
            token = _connecting.set(driver)
            try:
                record = self._create_connection()
            finally:
                _connecting.reset(token)
            self._records[driver] = record
        self._out.add(driver)
        return record

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        dbapi_connection = record.dbapi_connection
        if dbapi_connection is not None:
            self._out.discard(_driver_connection(record.driver_connection))
        else:  # invalidated: its driver connection is no longer known
            self._out = {c for c in self._out if self._records.get(c) is not record}

    def _close_connection(self, connection: Any, *, terminate: bool = False) -> None:
        # The store owns the connection: SQLAlchemy only forgets its wrapper.
        driver = _driver_connection(self._dialect.get_driver_connection(connection))
        self._records.pop(driver, None)
        self._out.discard(driver)

    def status(self) -> str:
        return f"ClaimPool: {len(self._records)} connections seen, {len(self._out)} in use"

    def recreate(self) -> ClaimPool:
        return self.__class__(
            self._creator,
            echo=self.echo,
            logging_name=self._orig_logging_name,
            reset_on_return=self._reset_on_return,
            _dispatch=self.dispatch,
            dialect=self._dialect,
        )

    def dispose(self) -> None:
        self._records.clear()


class _Statements:
    """What SQLAlchemy's asyncpg adapter sees of a claim's connection: the connection, except
    that `prepare` takes statements from asyncpg's own per-connection cache.

    A PreparedStatement that `prepare` returns dies when its connection goes back to the pool,
    so the adapter's own statement cache (turned off) would be useless across requests; asyncpg's
    cache outlives releases, is shared with the store's statements, and follows
    `statement_cache_size` (0 for PgBouncer: unnamed statements).
    """

    __slots__ = ("driver",)

    def __init__(self, connection: Any) -> None:
        self.driver = connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self.driver, name)

    async def prepare(
        self,
        query: str,
        *,
        name: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - asyncpg's signature
    ) -> Any:
        return await prepare_cached(self.driver, query, timeout)


async def _creator() -> Any:
    driver = _connecting.get()
    if driver is None:
        raise RuntimeError("a claim engine opens no connections of its own")
    return _Statements(driver)


def create_claim_engine(**options: Any) -> AsyncEngine:
    """An AsyncEngine whose every connection is the running claim's transaction.

    `options` go to `create_async_engine` (`echo`, `json_serializer`, ...). Make it once.
    """

    def creator() -> Any:
        # What `async_creator` does, plus turning the adapter's statement cache off.
        dbapi: Any = engine.sync_engine.dialect.dbapi
        return dbapi.connect(async_creator_fn=_creator, prepared_statement_cache_size=0)

    engine = _create_async_engine(
        "postgresql+idem_claim://", creator=creator, poolclass=ClaimPool, **options
    )
    return engine


class ClaimSessions:
    """Sessions in the claim's transaction: one engine, a session class, session options.

    `session_class` may be SQLModel's `AsyncSession`. `expire_on_commit` is off by default: a
    "commit" here only releases a savepoint, and reloading would cost a query for nothing.
    """

    def __init__(
        self,
        *,
        engine: AsyncEngine | None = None,
        session_class: type[AsyncSession] = AsyncSession,
        expire_on_commit: bool = False,
        **session_options: Any,
    ) -> None:
        self.engine = engine if engine is not None else create_claim_engine()
        self.factory: async_sessionmaker[Any] = async_sessionmaker(
            self.engine,
            class_=session_class,
            expire_on_commit=expire_on_commit,
            **session_options,
        )

    @asynccontextmanager
    async def session(self, request: Request | None = None) -> AsyncIterator[Any]:
        """A session for the claim of `request` (or of the current task).

        A clean exit commits what the session holds into the claim's transaction (it is written
        for good with the outcome); an exception rolls the session back and propagates.
        """
        if request is not None:
            try:
                get_context(request)
            except LookupError:
                raise RuntimeError(
                    "this endpoint uses a claim session, but no idempotency claim is active: is "
                    "IdempotencyMiddleware installed, the route guarded and its key required?"
                ) from None
        elif current_context() is None:
            raise RuntimeError("no idempotency claim is running in this task")
        session = self.factory()
        try:
            yield session
            transaction = session.get_transaction()
            if transaction is not None and transaction.is_active:
                await session.commit()
        finally:
            await session.close()

    async def dependency(self, request: Request) -> AsyncIterator[Any]:
        """The FastAPI dependency: `Depends(sessions.dependency)`."""
        async with self.session(request) as session:
            yield session


_default: ClaimSessions | None = None


def _sessions() -> ClaimSessions:
    global _default
    if _default is None:
        _default = ClaimSessions()
    return _default


def claim_engine() -> AsyncEngine:
    """The shared claim engine (for `async_sessionmaker(claim_engine(), ...)` of your own)."""
    return _sessions().engine


def open_claim_session(request: Request | None = None) -> Any:
    """`async with open_claim_session(request) as session:` (Starlette, jobs)."""
    return _sessions().session(request)


async def claim_session(request: Request) -> AsyncIterator[AsyncSession]:
    """FastAPI dependency: the request's AsyncSession in the claim's transaction."""
    async with open_claim_session(request) as session:
        yield session


try:
    from fastapi import Depends
except ImportError:  # pragma: no cover - Starlette without FastAPI
    pass
else:
    #: `session: ClaimSession` in a FastAPI endpoint.
    ClaimSession = Annotated[AsyncSession, Depends(claim_session)]
