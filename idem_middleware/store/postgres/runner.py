"""The store's own connections: borrowed from the pool, and given back without a reset when
they ran only the store's statements."""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ...delayed import Delayed
from ...errors import NOT_OPEN, ClaimBusy, StoreClosed, StoreError
from . import closing, compat
from .claim import claim_refused
from .convert import (
    CONNECTION_ERRORS,
    LOCK_NOT_AVAILABLE,
    RETRYABLE,
    SERVER_ERROR,
    STALE_STATEMENT,
    TRANSLATED,
    lock_waited,
    no_connection,
    scrub,
    translate,
)
from .lifecycle import Turns, check_loop, other_loop
from .options import check_pool
from .refusing import write_refused

logger = logging.getLogger("idem_middleware.store")
_running_loop = asyncio._get_running_loop


#: What a release may raise for a connection that cannot be reused: a reset the server refuses,
#: or a connection that is gone (dropped by the server or the network after its last statement:
#: asyncpg then reports an OSError, an InterfaceError or an InternalClientError).
RELEASE_ERRORS: tuple[type[BaseException], ...] = (SERVER_ERROR, *CONNECTION_ERRORS)


async def give_back(pool: Any, conn: Any, clean: weakref.WeakSet[Any] | None = None) -> None:
    """`pool.release(conn)`, for a connection whose transaction is over (committed or rolled
    back). A reset that fails on the way (the server refuses it, or the connection is gone) is
    logged, not raised: the connection is terminated, so the pool discards it (and opens another
    when it needs one), and the request's outcome stands. A cancellation is not caught.
    `clean`: the store's clean connections, when the pool's reset is the store's (one of them
    goes back without asyncpg's task: `compat.release_unshielded`)."""
    try:
        await (released(pool, conn, clean) or pool.release(conn))
    except RELEASE_ERRORS:
        logger.warning("a connection's reset failed on its way back to the pool", exc_info=True)
        discard(conn)


def released(pool: Any, conn: Any, clean: weakref.WeakSet[Any] | None) -> Any:
    """`compat.release_unshielded(pool, conn)` if `conn` is one of `clean` and not in a
    transaction (its release sends nothing), else None."""
    if clean is None:
        return None
    raw = compat.raw_connection(conn)
    if raw is None or raw not in clean or raw.is_in_transaction():
        return None
    return compat.release_unshielded(pool, conn)


def warn_ended(key: Any, which: str) -> None:
    """The handler ended `which` transaction itself before its outcome was recorded: a COMMIT,
    ROLLBACK or PREPARE TRANSACTION of its own on the connection it was given. Its writes up to
    then committed (or rolled back) without the outcome, and the key's claim (or the record's
    fence) was released with them; the outcome is recorded on its own, as the best account of
    what happened. Never silent: nothing else shows it."""
    logger.error(
        "the handler ended %s transaction itself (a COMMIT, ROLLBACK or PREPARE TRANSACTION on "
        "its connection): its writes did not commit with the outcome, and the key was not "
        "guarded from then on; use conn.transaction() (a savepoint) instead",
        which,
        extra={"tenant": key.tenant, "operation": key.operation},
    )


def discard(conn: Any) -> None:
    """Terminate the connection behind `conn` unless it is closed or given back already (asyncpg
    terminates it itself when a reset fails; this covers the errors raised before the reset).
    Its pool takes the terminated connection's slot back and opens a new one when needed."""
    raw = compat.raw_connection(conn)
    if raw is None:
        return  # given back: the proxy no longer reaches it, and it is someone else's now
    try:
        if not raw.is_closed():
            raw.terminate()
    except CONNECTION_ERRORS:
        logger.debug("terminating a lost connection failed", exc_info=True)


#: How many times a statement that is its own transaction runs before its serialization failure
#: or deadlock is reported (see `alone`).
_ATTEMPTS = 8

_T = TypeVar("_T")


async def alone(call: Callable[..., Awaitable[_T]], *args: Any, on: Any) -> _T:
    """`await call(*args)`: statements on the connection `on`, each committed on its own (no
    transaction around them), run again while the server refuses one for a serialization
    failure or a deadlock. A refused statement changed nothing, so running it again is safe.
    Under the default READ COMMITTED this never happens; a database or role whose
    `default_transaction_isolation` is REPEATABLE READ or SERIALIZABLE refuses them when they
    meet a concurrent write (a claim whose key another request just inserted, a settlement
    beside another's), and a lease-mode request whose downstream call was made was answered
    500 with its record left pending.

    Run again once, too, when a statement asyncpg prepared earlier is gone from the session (a
    handler that had the connection ran `DEALLOCATE ALL`): it never ran, and asyncpg prepares
    it again once its cache is emptied. Every later request on that connection failed so.
    A server's error that goes on is scrubbed first. (One coroutine, not one wrapping another:
    lease mode runs two of these per request.)"""
    healed = False
    try:
        for attempt in range(_ATTEMPTS - 1):
            try:
                return await call(*args)
            except RETRYABLE:
                # A little apart, so that two statements refused for each other do not meet.
                await asyncio.sleep(random.uniform(0, 0.001 * 2**attempt))
            except STALE_STATEMENT:
                if healed:
                    raise
                healed = True
                compat.forget_statements(on)
        return await call(*args)
    except SERVER_ERROR as exc:
        scrub(exc)  # (its DETAIL quotes the row: never in a message a server logs)
        raise


class Bounded:
    """A checkout waiting for the pool at most a deadline's delay (one timer serves every waiting
    checkout, as for a transactional session's in sessions.py): `due` cancels its task, and the
    checkout reports the timeout as StoreError (a 503). A cancellation from anyone else goes on."""

    __slots__ = ("expired", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.expired = False

    def due(self) -> None:
        self.expired = True
        if self.task is not None:
            self.task.cancel()

    def timed_out(self) -> bool:
        """Whether a cancellation was only the deadline's (then it is taken back)."""
        task = self.task
        return self.expired and task is not None and task.uncancel() == 0


async def checkout(pool: Any, deadline: Delayed) -> Any:
    """`pool.acquire()`, bounded by `deadline` (see Bounded)."""
    waiting = Bounded()
    waiting.task = asyncio.current_task()
    deadline.add(waiting)
    try:
        return await pool.acquire()
    except asyncio.CancelledError:
        if waiting.timed_out():
            raise StoreError("no database connection: TimeoutError") from None
        raise
    except SERVER_ERROR as exc:  # (the server refusing a new connection: see CHECKOUT_ERRORS)
        raise no_connection(exc) from exc
    finally:
        deadline.discard(waiting)


class PoolStatements:
    """Runs the store's statements on the pool, translating driver errors."""

    _pool: compat.AnyPool | None
    #: Whether close() ran since the last open() (a store never opened says how to open it).
    _closed: bool = False
    #: Bounds the wait for a connection of each checkout the store makes itself (lease mode's
    #: statements and fences, status lookups, operators' commands).
    _checkouts: Delayed
    # Connections that ran only the store's own statements since they were acquired: they
    # carry no session state (ours is all transaction-scoped), so the pool of our own skips
    # their reset query, a round trip per release. Any other connection is reset as usual.
    _clean: weakref.WeakSet[Any]

    @property
    def pool(self) -> compat.AnyPool:
        pool = self._pool
        if pool is None:
            raise StoreClosed("the store is closed" if self._closed else NOT_OPEN)
        if getattr(pool, "_loop", None) is not _running_loop():  # (checked by C calls alone)
            check_loop(pool)  # another loop's pool (None running: a caller outside any loop)
        return pool

    @property
    def is_open(self) -> bool:
        """Whether the store has a pool: opened and not closed since, or given a pool."""
        return self._pool is not None

    @property
    def in_another_loop(self) -> bool:
        """Whether the store's pool belongs to another event loop than the running one, which
        it then cannot serve (see lifecycle.py): the app's startup checks this."""
        return self._pool is not None and other_loop(self._pool)

    # (The store's, for `check_given_pool` and `let_cancelled_unwind`: see store.py.)
    _executions: closing.Executions
    _owns_pool: bool
    _opens: int
    _turns: Turns
    #: Whether `check_given_pool` ran its checks; the lifespans it serves (`release_given_pool`).
    _given_checked = False
    _given_lifespans = 0

    async def _open(self) -> None:
        raise NotImplementedError  # (PostgresStore's)

    async def _close_own_connections(self) -> Any:
        raise NotImplementedError  # (PostgresStore's)

    async def check_given_pool(self, lifespan: bool = False) -> None:
        """open()'s checks (the schema's migrations, the role's privileges, sessions that take
        writes, a pooler), once, on a pool the store was given and that was never opened: such
        a store counts as open, and nothing checked it (a database never migrated answered
        every guarded request a 500). The middleware's startup runs them. ConfigurationError as
        open() raises; the pool is the caller's, and stays open. Nothing for a store of its own
        pool, or one opened (or closed) since it was made: open() checks those."""
        async with self._turns():
            if self._owns_pool or self._opens or self._closed:
                return
            if self._pool is None or other_loop(self._pool):
                return  # (the middleware's startup names another loop's pool itself)
            if not self._given_checked:
                check_pool(self._pool, opening=True)  # (never awaited: every request a 503)
                await self._open()
                self._given_checked = True
            self._given_lifespans += lifespan  # (`lifespan`: a lifespan's startup asks)

    async def release_given_pool(self) -> None:
        """At the app's lifespan shutdown, for a store `check_given_pool` opened: its own two
        connections (the LISTEN and the lease renewals', outside the pool) closed, the pool
        left the app's. They stayed open for as long as the event loop lived, two more at each
        lifespan of a test's. The next startup checks and opens them again."""
        async with self._turns():
            self._given_lifespans = max(self._given_lifespans - 1, 0)
            if self._given_lifespans or not self._given_checked:
                return  # (another lifespan still serves it)
            if not (self._owns_pool or self._opens or self._closed):
                try:
                    await self._close_own_connections()
                finally:  # (failed or cancelled: the next startup opens them again all the same)
                    self._given_checked = False

    async def let_cancelled_unwind(self) -> None:
        """At the app's lifespan shutdown, before the app's own: the lease-mode executions a
        shutdown cancelled mark their records first (within `closing.CLOSE_SECONDS`). The
        store's `close` waits for them too, but a pool the store was given is the app's, and
        its lifespan closed it first: their marks failed, and the records stayed `pending`
        under a live lease (a `TAKEOVER` retry past it ran the handler again)."""
        await self._executions.unwound(closing.CLOSE_SECONDS)

    #: `_clean` when the pool's reset is the store's (it skips theirs), else None.
    _clean_releases: weakref.WeakSet[Any] | None = None

    def _mark_clean(self, conn: Any) -> bool:
        """`conn` (a pool's proxy) ran only our statements and is not in a transaction."""
        raw = compat.raw_connection(conn)
        if raw is not None and not raw.is_closed() and not raw.is_in_transaction():
            self._clean.add(raw)
            return True
        return False

    def _internal(self) -> _Internal:
        """A pooled connection for the store's own statements: released without a reset."""
        return _Internal(self)

    async def _run(self, method: str, query: str, *args: Any) -> Any:
        """`conn.<method>(query, *args)` on a connection of our own, in a transaction of its own
        (run again on a serialization failure, see `alone`); connection errors and serialization
        failures translated (StoreError, RetryableConflict; a lock wait past the server's
        `lock_timeout` too, see `lock_waited`)."""
        try:
            async with self._internal() as conn:
                return await alone(getattr(conn, method), query, *args, on=conn)
        except TRANSLATED as exc:
            raise translate(exc) from exc
        except LOCK_NOT_AVAILABLE as exc:
            raise lock_waited(exc) from exc

    async def _run_nowait(self, method: str, query: str, *args: Any) -> Any:
        """`_run` for a statement that locks its row `FOR UPDATE NOWAIT`: ClaimBusy when another
        session holds it (the caller waits without its connection and tries again)."""
        try:
            async with self._internal() as conn:
                return await alone(getattr(conn, method), query, *args, on=conn)
        except LOCK_NOT_AVAILABLE as exc:
            raise ClaimBusy("another session holds the record") from exc
        except TRANSLATED as exc:
            raise translate(exc) from exc
        except SERVER_ERROR as exc:  # (a constraint or trigger refusing `unknown`, say)
            raise claim_refused(exc) from exc

    async def _run_any(self, method: str, query: str, *args: Any) -> Any:
        """`_run`, with every other error the server reports translated too (StatementRefused):
        for the statements of tokens.py and outbox.py, whose callers expect no driver error."""
        try:
            return await self._run(method, query, *args)
        except SERVER_ERROR as exc:
            raise translate(exc) from exc

    async def _run_settling(self, method: str, query: str, *args: Any) -> Any:
        """`_run` for a lease-mode outcome written without a fence (settled, released, allowed
        a retry): an error no retry clears (a constraint or trigger on the store's table) is
        `write_refused`'s, a StoreError as the fenced settlement's refusals are. The driver's
        error escaped: the app's bare 500, and a lease job's record left pending (a TAKEOVER
        ran the job again)."""
        try:
            return await self._run(method, query, *args)
        except SERVER_ERROR as exc:
            raise write_refused(exc) from exc


class _Internal(Bounded):
    """`async with store._internal() as conn`: a pooled connection (waited for at most the
    store's bound, see Bounded), given back to the pool it came from; marked clean (no reset)
    unless the block raised. (A class, not a generator wrapped by `asynccontextmanager`, and
    its own deadline item, with the checkout and the release inline: lease mode takes one on
    every request.)"""

    __slots__ = ("_conn", "_owner", "_pool")

    def __init__(self, owner: PoolStatements) -> None:
        Bounded.__init__(self)
        self._owner = owner
        self._pool: Any = None
        self._conn: Any = None

    async def __aenter__(self) -> Any:
        """The connection behind the pool's proxy, for the block's statements: each call through
        the proxy is a Python function of asyncpg's more. The proxy is what goes back."""
        owner = self._owner
        pool = owner.pool
        deadline = owner._checkouts
        self.task = asyncio.current_task()
        deadline.add(self)
        try:
            self._conn = await pool.acquire()
        except asyncio.CancelledError:
            if self.timed_out():
                raise StoreError("no database connection: TimeoutError") from None
            raise
        except SERVER_ERROR as exc:  # (as `checkout`'s)
            raise no_connection(exc) from exc
        finally:
            deadline.discard(self)
            self.task = None
        self._pool = pool
        return compat.raw_connection(self._conn)

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        conn = self._conn
        owner = self._owner
        clean = False
        try:
            clean = exc_type is None and owner._mark_clean(conn)
        finally:
            # (give_back, inline: a lost connection is logged, and the block's error stands)
            try:
                if clean and owner._clean_releases is not None:
                    await (compat.release_unshielded(self._pool, conn) or self._pool.release(conn))
                else:
                    await self._pool.release(conn)
            except RELEASE_ERRORS:
                logger.warning(
                    "a connection's reset failed on its way back to the pool", exc_info=True
                )
                discard(conn)
