"""The driver's errors into the library's (rows and arguments: rows.py)."""

from __future__ import annotations

import logging
import re

import asyncpg

from ... import sql
from ...errors import (
    RetryableConflict,
    StatementRefused,
    StoreClosed,
    StoreError,
    TextRefused,
)
from ...observe import shown

_Q = sql.queries()
logger = logging.getLogger("idem_middleware.store")

CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    # A connection killed mid-operation can leave asyncpg's protocol in a state it reports this
    # way ("cannot switch to state ..."): the connection is gone all the same.
    asyncpg.exceptions.InternalClientError,
    # The server ending the session itself (FATAL): its crash recovery, the database dropped,
    # and `idle_session_timeout` or `idle_in_transaction_session_timeout` of the role or database.
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.DatabaseDroppedError,
    asyncpg.exceptions.IdleSessionTimeoutError,
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    # The server refusing the pool's next connection its login (a role disabled, a password
    # rotated): no connection, as when the server is down.
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
)
#: A server that is up but cannot serve the store for now: it takes no writes (a hot standby the
#: DSN reaches after a failover, or `default_transaction_read_only` set for maintenance), or it
#: is out of resources (class 53: `max_connections` or a role's or database's connection limit
#: reached, a full disk, out of memory). Nothing was written; the request may run later.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    asyncpg.exceptions.InsufficientResourcesError,
)
#: A statement the server cancelled (57014: the role's or database's `statement_timeout`, a
#: DBA's `pg_cancel_backend`): it did nothing, and may run later. (asyncpg's own timeouts raise
#: TimeoutError instead.)
CANCELLED: type[BaseException] = asyncpg.exceptions.QueryCanceledError
ACQUIRE_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *CONNECTION_ERRORS, *UNAVAILABLE)
RETRYABLE: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
)
#: Text the database's encoding cannot store (22P05: an emoji in a LATIN1 database; 22021):
#: a request's tenant, operation or key. Nothing was written, and the same request fails alike.
UNSTORABLE_TEXT: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.UntranslatableCharacterError,
    asyncpg.exceptions.CharacterNotInRepertoireError,
    # (54000: tenant, operation and key together too long for the primary key's index, 2,704
    # bytes; the middleware refuses such names first, the store's own callers may not)
    asyncpg.exceptions.ProgramLimitExceededError,
)
#: What `translate` turns into StoreError or RetryableConflict.
TRANSLATED: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    *UNAVAILABLE,
    *RETRYABLE,
    CANCELLED,
    *UNSTORABLE_TEXT,
)
#: `TRANSLATED` for the status resource's read, the first statement of its request: with the
#: DataError of a tenant the client encoding cannot carry (`unsendable_text`). (Elsewhere a
#: DataError, a trigger's or a constraint's, is the caller's to refuse: ClaimRefused, ...)
READ_TRANSLATED: tuple[type[BaseException], ...] = (*TRANSLATED, asyncpg.exceptions.DataError)
WAIT_EXCEEDED: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.QueryCanceledError,
)
UNIQUE_VIOLATION: type[BaseException] = asyncpg.exceptions.UniqueViolationError
#: A write refused in a read-only transaction (25006): the server's (a standby, sessions that
#: default to read-only: UNAVAILABLE), or the handler's own `SET TRANSACTION READ ONLY`.
READ_ONLY: type[BaseException] = asyncpg.exceptions.ReadOnlySQLTransactionError
#: A row locked `FOR UPDATE NOWAIT` that another session holds (a claim that never waits), or a
#: lock wait the server gave up on (the role's or database's `lock_timeout`: see `lock_waited`).
LOCK_NOT_AVAILABLE: type[BaseException] = asyncpg.exceptions.LockNotAvailableError
#: A statement prepared on the session is gone: a handler dropped the session's statements
#: (`DEALLOCATE ALL`) while asyncpg's cache (or the fast path) still names them.
STALE_STATEMENT: type[BaseException] = asyncpg.exceptions.InvalidSQLStatementNameError
#: A claim's completion whose connection is gone: lost (asyncpg then says "released back to
#: the pool" too), or released back to the pool by the handler; its transaction rolled back.
CLAIM_CONNECTION_GONE = (
    "the claim's connection was lost, or released back to the pool by the handler, before the "
    "outcome was recorded: nothing of the attempt committed"
)
#: Any error the server reports for one statement.
SERVER_ERROR: type[BaseException] = asyncpg.PostgresError
#: What a checkout from the pool fails with: `ACQUIRE_ERRORS`, and any error the server reports
#: while it starts a new connection (no statement of the request has run): 55000, a database
#: closed to connections for maintenance (`ALLOW_CONNECTIONS false`), 3D000 one dropped or
#: renamed, or the pool's own `init` or `setup` refused. A 503 (it was a 500).
CHECKOUT_ERRORS: tuple[type[BaseException], ...] = (*ACQUIRE_ERRORS, SERVER_ERROR)


def is_conflict(exc: BaseException) -> bool:
    """Whether the server refused a transaction in a way that running it again may clear: the
    error itself, or one it was raised from (SQLAlchemy raises its own errors from asyncpg's,
    through its adapter's: a conflict met in a claim session is one too); a group's (a task
    group in the handler) when every error in it is one."""
    return all(_caused_by(error, _CONFLICTS) for error in leaf_errors(exc))


def stale_statement(exc: BaseException) -> bool:
    """Whether a statement prepared on the session was dropped under it (STALE_STATEMENT): the
    error, one it was raised from (SQLAlchemy's), or one in its group."""
    return any(_caused_by(error, STALE_STATEMENT) for error in leaf_errors(exc))


def _dropped_by_name(exc: BaseException) -> bool:
    """A STALE_STATEMENT that names a statement asyncpg or the store prepared (`__asyncpg_...`,
    `idem_..._<digest>`): one a handler named itself (`EXECUTE my_plan` of a plan it never
    prepared) is its own error, the same at every run (taken for a dropped cache, it ran four
    times). By the name alone: the server translates the message, its quotes too (»...«)."""
    return _PREPARED_NAME.search(str(exc)) is not None


#: The names asyncpg (`__asyncpg_stmt_1f__`) and the fast path (`fused._prepared_name`) prepare.
_PREPARED_NAME = re.compile(r"__asyncpg_[a-z]+_[0-9a-f]+__|\bidem_[a-z_]+_[0-9a-f]{12}\b")


def reports_lost(exc: BaseException) -> bool:
    """Whether `exc`, one it was raised from or during (a handler's own error wrapping it), or
    one in its group is the driver's report of a connection gone."""
    return any(_caused_by(error, CONNECTION_ERRORS, implicit=True) for error in leaf_errors(exc))


def _caused_by(
    exc: BaseException,
    kinds: type[BaseException] | tuple[type[BaseException], ...],
    implicit: bool = False,
) -> bool:
    """Whether `exc`, or an error it was raised from (`implicit`: or during), is one of `kinds`;
    a chain of at most `_CAUSES`."""
    cause: BaseException | None = exc
    for _ in range(_CAUSES):
        if cause is None:
            return False
        if isinstance(cause, kinds):
            return not isinstance(cause, STALE_STATEMENT) or _dropped_by_name(cause)
        cause = cause.__cause__ or (cause.__context__ if implicit else None)
    return False


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The errors an exception group holds, its nested groups' too (a handler's `TaskGroup`, or
    anyio's, wraps what its tasks raised), else `exc` alone. Bounded: groups past
    `_GROUPS` are listed as they are (then no test on their errors matches them)."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    errors: list[BaseException] = []
    groups: list[BaseExceptionGroup[BaseException]] = [exc]
    for _ in range(_GROUPS):
        if not groups:
            break
        for error in groups.pop().exceptions:
            if isinstance(error, BaseExceptionGroup):
                groups.append(error)
            else:
                errors.append(error)
    return errors + list(groups)


_CONFLICTS: tuple[type[BaseException], ...] = (
    RetryableConflict,
    *RETRYABLE,
    # A statement of the session's dropped under it (a handler's DEALLOCATE ALL): the attempt
    # runs again once asyncpg's cache of them is emptied (`stale_statement`, sessions.py).
    STALE_STATEMENT,
    # A statement plan a migration invalidated (ALTER TABLE under a cached `SELECT *`): asyncpg
    # re-prepares it by itself only outside a transaction, and has dropped it from its cache.
    asyncpg.exceptions.InvalidCachedStatementError,
)
#: How much of a DETAIL or CONTEXT the DEBUG line shows (a refused row's body can be megabytes).
_SHOWN_CHARS = 2000
#: How far down an error's causes `is_conflict` looks (SQLAlchemy's is two down; bounded).
_CAUSES = 8
#: How many exception groups `leaf_errors` opens (nested task groups; bounded).
_GROUPS = 64


def scrub(exc: BaseException) -> BaseException:
    """Drop PostgreSQL's DETAIL from an error of one of the store's own statements: it quotes
    the row refused (`Failing row contains (tenant, operation, key, ..., \\x<body>...)`, or a
    unique violation's `Key (...)=(...)`), and asyncpg makes it part of the error's text, which
    a server logs with the traceback at ERROR. The SQLSTATE, constraint, table and message
    stay; the DETAIL goes to a DEBUG line (docs/security.md). So does the CONTEXT (asyncpg's
    `context`), which quotes every parameter of the statement (`unnamed portal with parameters:
    $1 = 'tenant', $2 = ...`) where the server's `log_parameter_max_length_on_error` is set: not
    in the error's text, but in the attributes an error tracker records. asyncpg's `query`,
    which it sets on an error of a statement sent as text (the fast path's, its values inlined
    as literals), is dropped without a trace: the statement is the library's own."""
    if not isinstance(exc, SERVER_ERROR):
        return exc
    for field in ("detail", "context"):
        value = getattr(exc, field, None)
        if value:
            # (escaped: a tenant's line break forges no log line of its own)
            shown_value = shown(str(value), _SHOWN_CHARS)
            logger.debug("the server's %s of %s: %s", field, type(exc).__name__, shown_value)
            setattr(exc, field, None)
    if getattr(exc, "query", None) is not None:
        exc.query = None  # type: ignore[attr-defined]
    return exc


def unsendable_text(exc: BaseException) -> bool:
    """asyncpg's own refusal to send a parameter (before the statement is sent: its DataError
    from a UnicodeEncodeError), a text the connection's `client_encoding` cannot carry (`東京`
    under LATIN1), the only kind of value of a store's statements that can fail so. Its text,
    which quotes the value (a tenant, a raw key) and is logged with the traceback of whatever
    it is raised into, is replaced. (It escaped the claim as it was: the server's bare 500.)"""
    if type(exc) is not asyncpg.exceptions.DataError:
        return False
    if not isinstance(exc.__cause__, UnicodeEncodeError):
        return False
    exc.args = ("a query argument cannot be sent in the client_encoding (the value not shown)",)
    return True


def no_connection(exc: BaseException) -> StoreError:
    """A checkout that failed with `exc`: StoreClosed for a pool closed (its app's, given to the
    store: asking again cannot help), else a StoreError naming the error by its type (one that
    timed out carries no message)."""
    if isinstance(closed := translate(exc), StoreClosed):
        return closed
    return StoreError(f"no database connection: {type(exc).__name__}")


#: What asyncpg's pool says, closed (`Pool._check_init`).
_POOL_CLOSED = ("pool is closed", "pool is closing")


def translate(exc: BaseException) -> BaseException:
    scrub(exc)
    if isinstance(exc, RETRYABLE):
        return RetryableConflict(str(exc))
    if isinstance(exc, asyncpg.exceptions.InterfaceError) and str(exc).startswith(_POOL_CLOSED):
        # (A pool given to the store and closed by its app: asking again cannot help.)
        return StoreClosed(f"the store's pool is closed: {exc}")
    if isinstance(exc, CONNECTION_ERRORS):
        return StoreError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, asyncpg.exceptions.ReadOnlySQLTransactionError):
        return StoreError(f"the database takes no writes (a standby, or read-only sessions): {exc}")
    if isinstance(exc, CANCELLED):
        return StoreError(f"the server cancelled the statement (statement_timeout?): {exc}")
    if isinstance(exc, UNAVAILABLE):
        return StoreError(f"the database is out of resources: {type(exc).__name__}: {exc}")
    if unsendable_text(exc):
        return TextRefused(
            "a tenant, operation or key cannot be sent in the connection's client_encoding"
            " (asyncpg's DataError from a UnicodeEncodeError; the value not shown)"
        )
    if isinstance(exc, UNSTORABLE_TEXT):
        return TextRefused(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, SERVER_ERROR):
        return StatementRefused(f"{type(exc).__name__}: {exc}")
    return exc


def lock_waited(exc: BaseException) -> StoreError:
    """A statement that waits for its row's lock (lease mode's fence, settlement and release,
    a lease claim behind another's uncommitted one) cancelled by the server's `lock_timeout`
    (55P03, set on the role or database): it did nothing, as under `statement_timeout`, and
    the request is answered 503. (It escaped as a plain 500.) The statements that lock NOWAIT
    raise the same error at once, meaning "busy": their callers catch it before this."""
    scrub(exc)
    return StoreError(f"waited longer than the server's lock_timeout for a row lock: {exc}")


def claim_connection_gone(idle: float) -> str:
    """Why a claim's connection is gone, as far as the store can tell (`idle`: the server's
    `idle_in_transaction_session_timeout`, 0 when none)."""
    if not idle:
        return CLAIM_CONNECTION_GONE
    return (
        f"{CLAIM_CONNECTION_GONE} (the server ends a session idle in a transaction for {idle:g}"
        " s, idle_in_transaction_session_timeout: a handler waiting longer between two "
        "statements loses its connection)"
    )
