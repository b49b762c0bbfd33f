"""The engine behind claim sessions (`idem_middleware.sqla`): a dialect, a pool that lends the
running claim's connection, and the wrapper SQLAlchemy's asyncpg adapter sees of it.

Every checkout hands out the connection of the claim running in the current task, wrapped once
per connection (SQLAlchemy's prepared-statement cache survives between requests) and bound to the
claim: once the claim gives it back, or from another claim's task, a statement raises asyncpg's
InterfaceError, and never reaches the request that holds the connection next.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import asyncpg
from asyncpg import InterfaceError

try:
    from sqlalchemy import util as _sa_util
    from sqlalchemy.dialects import registry
    from sqlalchemy.dialects.postgresql import json as _pg_json
    from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine
    from sqlalchemy.pool import Pool
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "sqlalchemy", exc) from exc

from .context import current_context
from .errors import ConfigurationError
from .store.postgres.compat import prepare_cached, raw_connection

if TYPE_CHECKING:
    from sqlalchemy.pool import ConnectionPoolEntry

__all__ = ["ClaimDialect", "ClaimPool", "create_claim_engine"]

logger = logging.getLogger("idem_middleware")

#: The session's savepoint is gone from under it: the handler ended the claim's transaction.
ENDED_BY_HANDLER = (
    asyncpg.exceptions.NoActiveSQLTransactionError,
    asyncpg.exceptions.InvalidSavepointSpecificationError,
)

# `await_only` is the name SQLAlchemy 2.0 exports; 2.1 calls it `await_` (the old name goes in 2.2).
_await: Any = getattr(_sa_util, "await_", None) or _sa_util.await_only

# The driver connection a checkout is creating a DBAPI wrapper for, the acquisition (the pool's
# proxy) it is lent under, and the claim it is lent to (read by `_creator`).
_connecting: ContextVar[tuple[Any, Any, Any] | None] = ContextVar(
    "idem_middleware_sqla_connecting", default=None
)


def _released() -> InterfaceError:
    return InterfaceError(
        "the claim's connection has been released back to the pool: writes after the response "
        "started (or after the claim ended) are outside the claim; use a connection of your own"
    )


def _statements(record: ConnectionPoolEntry) -> _Statements | None:
    statements = record.driver_connection if record.dbapi_connection is not None else None
    return statements if isinstance(statements, _Statements) else None


def _soft_invalidated(record: ConnectionPoolEntry) -> bool:
    """Soft-invalidated (`invalidate(soft=True)`, or a hard one that was interrupted)."""
    entry: Any = record  # (a _ConnectionRecord)
    return bool(entry._soft_invalidate_time > entry.starttime)


class ClaimDialect(PGDialect_asyncpg):
    """asyncpg, without SQLAlchemy's JSON codecs on the store's connections (the stock dialect
    registers them on each; the outbox and raw-asyncpg handlers expect asyncpg's own text
    decoding there). SQLAlchemy parses JSON itself instead."""

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

    # The session's transaction is a savepoint, which takes none of a transaction's
    # characteristics: AUTOCOMMIT would skip it (`session.rollback()` undoing nothing), READ ONLY
    # would be dropped without a word, another isolation level fails on every statement.
    def set_isolation_level(self, dbapi_connection: Any, level: Any) -> None:
        raise _characteristic("isolation_level", level)

    def set_readonly(self, connection: Any, value: Any) -> None:
        if value:
            raise _characteristic("postgresql_readonly", value)

    def set_deferrable(self, connection: Any, value: Any) -> None:
        if value:
            raise _characteristic("postgresql_deferrable", value)

    # A two-phase session (`twophase=True`) would prepare and commit the claim's own transaction
    # out of band at `session.commit()`, its writes without the outcome: refused at its begin.
    def do_begin_twophase(self, connection: Any, xid: Any) -> None:
        raise _characteristic("twophase", True)


def _characteristic(name: str, value: Any) -> ConfigurationError:
    return ConfigurationError(
        f"a claim session cannot take {name}={value!r}: its transaction is a savepoint in the "
        "claim's, whose characteristics are the database's defaults"
    )


registry.register("postgresql.idem_claim", __name__, "ClaimDialect")


# Driver connection -> the pool entry (of whichever ClaimPool) holding it while checked out.
_OUT: dict[Any, ConnectionPoolEntry] = {}


class ClaimPool(Pool):
    """Hands out the current claim's connection; never opens or closes one of its own."""

    _is_asyncio = True

    def __init__(self, creator: Any, **kw: Any) -> None:
        super().__init__(creator, **kw)
        self._records: dict[Any, ConnectionPoolEntry] = {}  # driver connection -> its entry
        # ... -> the entry holding it, of any claim engine: two engines' sessions would otherwise
        # nest savepoints on one connection and release each other's.
        self._out = _OUT

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
        driver = raw_connection(connection)  # the connection behind the claim's proxy
        if driver is None:  # the claim gave it back already (a stream's session, say)
            raise _released()
        held = self._out.get(driver)
        if held is not None:
            lent = _statements(held)
            if lent is not None and lent.proxy is connection:
                raise RuntimeError(
                    "the claim's connection is already in use by another SQLAlchemy connection: "
                    "use one session per request (a FastAPI dependency gives every dependant the "
                    "same one)"
                )
            # Still held by the session of a claim that has ended (a streaming response's): that
            # entry stays bound to its released proxy (its statements fail), in whichever claim
            # engine kept it; this claim gets one of its own.
            del self._out[driver]
            if lent is not None:
                lent.retired = True
        record = self._records.get(driver)
        statements = _statements(record) if record is not None else None
        if record is None or statements is None or statements.retired or _soft_invalidated(record):
            # A connection the pool has not seen (or an entry SQLAlchemy would recycle at its
            # checkout: it opens none of its own): forget the closed ones first.
            for old in [c for c in self._records if c.is_closed()]:
                del self._records[old]
            token = _connecting.set((driver, connection, context))
            try:
                record = self._create_connection()
            finally:
                _connecting.reset(token)
            self._records[driver] = record
        else:
            statements.proxy, statements.context = connection, context  # this claim's, now
        self._out[driver] = record
        return record

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        # (An entry replaced while out, see `_do_get`, no longer stands for its connection.)
        statements = _statements(record)
        if statements is not None:
            if self._out.get(statements.driver) is record:
                del self._out[statements.driver]
        else:  # invalidated: its driver connection is no longer known
            for driver in [c for c, r in self._out.items() if r is record]:
                del self._out[driver]

    def _invalidate(
        self, connection: Any, exception: BaseException | None = None, _checkin: bool = True
    ) -> None:
        """A disconnect invalidates the connection that died, not the pool: SQLAlchemy's would
        mark every connection seen so far for recycling at its next checkout, which a claim
        engine cannot do (it opens none of its own), failing the healthy requests on them. The
        store's pool replaces a dead connection; `_do_get` gives the new one an entry."""
        if _checkin and getattr(connection, "is_valid", False):
            connection.invalidate(exception)

    def _close_connection(self, connection: Any, *, terminate: bool = False) -> None:
        # The store owns the connection: SQLAlchemy only forgets its wrapper (if still kept).
        statements = self._dialect.get_driver_connection(connection)
        driver = getattr(statements, "driver", statements)
        for entries in (self._records, self._out):
            entry = entries.get(driver)
            if entry is not None and entry.dbapi_connection is connection:
                del entries[driver]

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
    that `prepare` takes statements from asyncpg's own per-connection cache, and that it is the
    connection only while the claim's acquisition (`proxy`) holds it.

    A PreparedStatement that `prepare` returns dies when its connection goes back to the pool,
    so the adapter's own statement cache (turned off) would be useless across requests; asyncpg's
    cache outlives releases, is shared with the store's statements, and follows
    `statement_cache_size` (0 for PgBouncer: unnamed statements).

    Every use goes through `_live`: once the proxy was released (the claim ended, or its stream
    started), the connection may already serve another request, and a statement raises
    InterfaceError instead of running in that request's transaction; so does one from the task of
    another claim or none (a session shared by requests), which would commit with this claim.
    """

    __slots__ = ("context", "driver", "proxy", "retired")

    def __init__(self, driver: Any, proxy: Any, context: Any) -> None:
        self.driver = driver  # the real connection (the pool's entry is kept per one)
        self.proxy = proxy  # the acquisition lent to the current checkout
        self.context = context  # the claim it is lent to
        self.retired = False  # left to a claim that ended: never lent to another one

    def _live(self) -> Any:
        if raw_connection(self.proxy) is not self.driver:
            raise _released()
        _same_claim(self.context)
        return self.driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._live(), name)

    def is_closed(self) -> bool:
        # Not for a released proxy: SQLAlchemy would invalidate the session's connection, and
        # its end (commit or rollback, nothing left to do, see `_Savepoint`) would raise too.
        return bool(self.driver.is_closed())

    def transaction(self, **options: Any) -> _Savepoint:
        return _Savepoint(self, self._live().transaction(**options))

    async def prepare(
        self,
        query: str,
        *,
        name: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - asyncpg's signature
    ) -> Any:
        return await prepare_cached(self._live(), query, timeout)


def _same_claim(context: Any) -> bool:
    """True in a task of `context`'s claim; InterfaceError in another's, or in none's."""
    if current_context() is not context:  # (a session shared by requests: see _Statements)
        raise InterfaceError("the session is another request's: use one session per request")
    return True


class _Savepoint:
    """The session's transaction (a savepoint in the claim's). Once the claim's connection was
    given back, the claim's transaction has ended with everything the session wrote in it:
    committing or rolling back the savepoint then has nothing left to do (a write still pending
    in the session fails at its flush)."""

    __slots__ = ("_context", "_driver", "_proxy", "_tx")

    def __init__(self, statements: _Statements, tx: Any) -> None:
        self._proxy, self._tx = statements.proxy, tx
        self._driver, self._context = statements.driver, statements.context

    def _held(self) -> bool:
        # (Ended from another claim's task, a shared session's `rollback()` in its error path,
        # it rolled this claim's writes back while its outcome was recorded as succeeded.)
        return raw_connection(self._proxy) is self._driver and _same_claim(self._context)

    async def start(self) -> None:
        await self._tx.start()

    async def commit(self) -> None:
        if self._held():
            await self._end(self._tx.commit)

    async def rollback(self) -> None:
        if self._held():
            await self._end(self._tx.rollback)

    async def _end(self, end: Any) -> None:
        """The savepoint's end, unless the handler ended the claim's transaction itself (a
        `COMMIT` or `ROLLBACK` sent through the session): then its savepoint is gone, what the
        session wrote since is committed already, and failing here would leave those writes
        without the outcome that says they happened (a retry would make them again). The
        outcome is recorded, and the store logs the ended transaction as an error."""
        if not self._driver.is_in_transaction():
            return
        try:
            await end()
        except ENDED_BY_HANDLER:  # COMMIT then BEGIN: a transaction, but not the claim's
            logger.error(
                "the handler ended the claim's transaction itself (a COMMIT or ROLLBACK sent "
                "through its claim session): its writes did not commit with the outcome"
            )


async def _creator() -> Any:
    connecting = _connecting.get()
    if connecting is None:
        raise RuntimeError("a claim engine opens no connections of its own")
    return _Statements(*connecting)


# Options of `create_async_engine` that pick a connection, a pool or a transaction's isolation.
_CLAIM_DECIDES = frozenset(
    {"url", "creator", "async_creator", "connect_args", "poolclass", "pool", "isolation_level"}
)

# Execution options that would set the session transaction's characteristics (see ClaimDialect).
_TRANSACTION_OPTIONS = frozenset(
    {"isolation_level", "postgresql_readonly", "postgresql_deferrable"}
)


def refuse_characteristics(execution: Any) -> None:
    """Execution options that would choose the transaction's characteristics are refused."""
    for name in sorted(_TRANSACTION_OPTIONS.intersection(execution)):
        if name == "isolation_level" or execution[name]:
            raise _characteristic(name, execution[name])


def create_claim_engine(**options: Any) -> AsyncEngine:
    """An AsyncEngine whose every connection is the running claim's transaction.

    `options` go to `create_async_engine` (`echo`, `json_serializer`, ...). Make it once. The
    claim decides the connection and its transaction: options that would choose them are refused.
    """
    chosen = sorted(_CLAIM_DECIDES.intersection(options))
    if chosen:
        raise ConfigurationError(
            f"create_claim_engine() does not take {', '.join(chosen)}: its connection is the "
            "claim's, in the claim's transaction (an engine of your own would write outside it)"
        )
    # SQLAlchemy would close a connection past pool_recycle and open one of its own (it cannot:
    # every checkout after it failed), and ping one the claim has just used (three round trips).
    if options.get("pool_recycle", -1) != -1 or options.get("pool_pre_ping"):
        raise ConfigurationError(
            "create_claim_engine() does not take pool_recycle or pool_pre_ping: the store's pool "
            "owns the connections (PostgresStore's connect_kwargs, e.g. "
            "max_inactive_connection_lifetime)"
        )
    refuse_characteristics(options.get("execution_options") or {})

    def creator() -> Any:
        # What `async_creator` does, plus turning the adapter's statement cache off.
        dbapi: Any = engine.sync_engine.dialect.dbapi
        return dbapi.connect(async_creator_fn=_creator, prepared_statement_cache_size=0)

    engine = _create_async_engine(
        "postgresql+idem_claim://", creator=creator, poolclass=ClaimPool, **options
    )
    return engine
