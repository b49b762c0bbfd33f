"""The PostgreSQL store (asyncpg): its lifecycle and the operations that commit on their own.
It runs named queries and translates driver errors; the protocol's decisions live in the
middleware. The sessions it hands out are in sessions.py, the fast path in fused.py."""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import asyncpg

from ...delayed import Delayed
from ...errors import ConfigurationError, StoreClosed, StoreError
from ..base import Claim, Record, RecordKey, Settlement, State, Store
from ..migrations import require_migrated
from . import closing, compat
from .claim import claim, claim_refused
from .claim_lock import ClaimLocks
from .convert import (
    _Q,
    ACQUIRE_ERRORS,
    CANCELLED,
    LOCK_NOT_AVAILABLE,
    SERVER_ERROR,
    TRANSLATED,
    lock_waited,
    no_connection,
    translate,
)
from .edges import OffPathStatements
from .fenced import Fencing
from .fused import FastPath
from .lifecycle import Turns, pool_when_ready, refuse_other_loop
from .listener import Listener
from .options import check_dsn, check_pool, check_store_options
from .poolers import PREPARED_MISMATCH, refusal, require_sessions_to_listen, require_transactions
from .poolers import check as check_pooler
from .privileges import require_generations_ahead, require_privileges, require_writable
from .renewals import Renewals, bound
from .rows import notify_token, settle_args, to_record
from .runner import alone
from .sessions import PgTransaction

logger = logging.getLogger("idem_middleware.store")


class PostgresStore(OffPathStatements):
    """The PostgreSQL store. Borrows the caller's asyncpg pool, or creates (and closes) its own.

    For PgBouncer in transaction pooling mode pass `statement_cache_size=0`.

    `fast_path=False` sends the transactional claim and completion as parameterised statements
    of their own, with BEGIN and COMMIT apart (two round trips more per fresh request, and no
    reliance on asyncpg's private transaction attributes; see compat.py).
    """

    def __init__(
        self,
        *,
        pool: compat.AnyPool | None = None,
        dsn: str | None = None,
        min_size: int = 2,
        max_size: int = 10,
        statement_cache_size: int = 100,
        application_name: str = "idem_middleware",
        connect_kwargs: dict[str, Any] | None = None,
        listen: bool = True,
        listen_dsn: str | None = None,
        fast_path: bool = True,
        acquire_timeout: float = 10.0,
    ) -> None:
        if (pool is None) == (dsn is None):
            raise ValueError("pass exactly one of pool= or dsn=")
        check_dsn(dsn)
        check_dsn(listen_dsn or None, "listen_dsn")  # ("": the dsn's, as before)
        made = (min_size, max_size, statement_cache_size, application_name, connect_kwargs)
        check_store_options(pool, listen, fast_path, made)
        check_pool(pool)
        if (
            isinstance(acquire_timeout, bool)
            or not isinstance(acquire_timeout, int | float)
            or not 0 < acquire_timeout < math.inf
        ):
            raise ConfigurationError(
                f"acquire_timeout must be a positive number of seconds, not {acquire_timeout!r}"
            )
        self._checkouts = Delayed(acquire_timeout)
        self._pool = pool
        self._owns_pool = pool is None
        self._dsn = dsn
        self._listen = listen
        self._listen_dsn = listen_dsn or dsn
        self._listener = Listener(
            enabled=listen,
            connect=self._listen_connection,
            execute=self._execute_statement,
        )
        #: Lease renewals' own connection, outside the pool (see renewals.py).
        self._renewals = Renewals(self._renewal_connection, self._run)
        self._locks = ClaimLocks()
        self._executions = closing.Executions(self.release, self._run)
        self._turns = Turns()
        #: How many opens the closes still owe (see `open`).
        self._opens = 0
        #: Whether `open` refuses a server that takes no writes (the command line's reports run
        #: on a standby or as a read-only role as well).
        self._needs_writes = True
        #: idle_in_transaction_session_timeout as `open` found it (s; 0: none), for lost claims.
        self.idle_in_transaction = 0.0
        #: The deadlines of transaction sessions' waits for the pool, one per acquire timeout.
        self._deadlines: dict[float, Delayed] = {}
        self._pool_kwargs: dict[str, Any] = {
            "min_size": min_size,
            "max_size": max_size,
            "statement_cache_size": statement_cache_size,
            **(connect_kwargs or {}),
        }
        # (The caller's server settings beside the store's name, not in its place: renewals'
        # and the listener's connections are named after it.)
        given = (connect_kwargs or {}).get("server_settings") or {}
        settings = {"application_name": application_name, **given}
        self._pool_kwargs["server_settings"] = settings
        self._clean = weakref.WeakSet()  # see PoolStatements
        self._pool_kwargs.setdefault("reset", self._reset_connection)
        # The fast path's COMMIT carries the reset of a connection a handler had (and a clean
        # one goes back unshielded) when the reset is ours to skip (a pool of our own, no
        # `reset` of the caller's).
        own_reset = pool is None and self._pool_kwargs["reset"] == self._reset_connection
        self._clean_releases = self._clean if own_reset else None
        self._fast = FastPath(self._clean_releases) if fast_path else None

    async def _reset_connection(self, conn: Any) -> None:
        """The reset of our own pool (asyncpg has already rolled back any open transaction and
        dropped client-side listeners): the server-side reset, unless `conn` is clean."""
        try:
            self._clean.remove(conn)  # (one call of WeakSet's where `in` and `discard` were two)
            return
        except KeyError:
            pass
        query = compat.reset_query(conn)
        if query:
            await conn.execute(query)

    async def open(self) -> PostgresStore:
        """Create the pool (unless one was given), and check that the database has every
        migration this version needs and takes writes (not a standby, sessions not read-only):
        ConfigurationError, naming the fix, if not (a pooler in statement mode, too). A server
        that cannot be reached yet is no reason to refuse (requests answer 503 until it is):
        the check is then skipped, with a warning.

        Opens nest: an open store opened again (a test's fixture, then the app's lifespan) is
        only counted, and each open needs its close; the last closes it. An open store is
        opened again only in the event loop of its pool (ConfigurationError otherwise, see
        lifecycle.py). An open and a close wait for the one under way."""
        async with self._turns():
            if self._pool is not None:
                check_pool(self._pool, opening=True)
                refuse_other_loop(self._pool, "open the store")
            if self._opens:
                self._opens += 1
                return self
            await self._open()
            self._opens = 1
        return self

    async def _open(self) -> None:
        created = self._pool is None
        self._closed = False
        self._listener.resume()
        self._renewals.resume()
        if self._pool is None:
            try:
                self._pool = await pool_when_ready(
                    self._dsn, self._pool_kwargs, self._checkouts.delay
                )
            except (ValueError, OverflowError) as exc:  # (a port "abc", `sslmode=bogus`: asyncpg's
                # parse, which its ClientConfigurationError is part of; a port out of range)
                raise ConfigurationError(
                    f"PostgresStore: asyncpg cannot connect with this dsn or connect_kwargs: {exc}"
                ) from exc
            except (*ACQUIRE_ERRORS, CANCELLED) as exc:  # (CANCELLED: a tiny statement_timeout)
                raise StoreError(f"cannot connect: {exc}") from exc
        try:
            if self._needs_writes:
                async with self._internal() as conn:
                    await require_transactions(conn)  # (a pooler in statement mode: refused)
            await check_pooler(self.pool, self._checkouts.delay)
            if self._listen and self._listen_dsn == self._dsn:  # (LISTEN through the pool's DSN)
                await require_sessions_to_listen(self.pool, self._checkouts.delay)
            async with self._internal() as conn:
                try:
                    await require_migrated(conn)
                    if self._needs_writes:
                        await require_privileges(conn, self._locks)
                        self.idle_in_transaction = await require_writable(conn)
                        await require_generations_ahead(conn)
                    await self._locks.load(conn)
                except PREPARED_MISMATCH as exc:  # what the pooler check may not have seen
                    raise refusal(compat.statement_cache_size(conn), exc) from exc
        except ACQUIRE_ERRORS as exc:
            # (Named by its type: a checkout that timed out carries no message.)
            logger.warning(
                "cannot check the idempotency schema now: %s%s",
                type(exc).__name__,
                f": {exc}" if str(exc) else f" (no connection within {self._checkouts.delay} s)",
            )
        except BaseException as exc:
            if created and self._pool is not None:
                pool, self._pool = self._pool, None
                await pool.close()
            if isinstance(exc, CANCELLED):  # (statement_timeout shorter than the checks)
                raise translate(exc) from exc
            raise

    async def close(self) -> None:
        """Close the listener, the renewals' connection and the pool (if the store created it),
        lease-mode executions a shutdown cancelled settled first, within CLOSE_SECONDS. A
        nested open's close only counts it (see `open`); a close waits for the one under way."""
        async with self._turns():
            if self._opens > 1:
                self._opens -= 1
                return
            self._opens = 0
            await self._close()

    async def _close(self) -> None:
        self._closed = True
        budget = await self._close_own_connections()
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            await closing.close_pool(pool, budget.left())

    async def _close_own_connections(self) -> closing.Budget:  # (the pool's stay)
        budget = closing.Budget()
        await self._executions.unwound(budget.left())
        await self._listener.close(budget.left())
        await self._renewals.close(budget.left())
        return budget

    async def __aenter__(self) -> PostgresStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def bound_checkouts(self, acquire_timeout: float) -> None:
        """Wait at most `acquire_timeout` for a connection in the store's own checkouts too (lease
        mode's, the status resource's): an IdempotencyMiddleware gives the store its own bound
        (the smallest, if several share the store)."""
        if acquire_timeout < self._checkouts.delay:
            self._checkouts = Delayed(acquire_timeout)

    def transaction(self, *, acquire_timeout: float) -> PgTransaction:
        deadline = self._deadlines.get(acquire_timeout)
        if deadline is None:
            deadline = self._deadlines[acquire_timeout] = Delayed(acquire_timeout)
        return PgTransaction(self, deadline)

    async def get(self, key: RecordKey) -> Record | None:
        try:
            # (`_run` translates what the server cancels: a `statement_timeout` or `lock_timeout`
            # behind a migration's lock, say.)
            row = await self._run("fetchrow", _Q["get"], key.tenant, key.operation, key.key)
        except ACQUIRE_ERRORS as exc:  # (a new connection's own timeout)
            raise no_connection(exc) from exc
        return None if row is None else to_record(key, row)

    # -- lease mode ------------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        lease_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        args = (
            key.tenant,
            key.operation,
            key.key,
            fingerprint,
            "lease",
            retention_seconds,
            lease_seconds,
        )
        # (Run to its end, a cancelled request's too: see `closing.Executions.claim`.)
        # (A server that stops answering: a 503, not a hang. Its checkout waits the bound once:
        # the statement gets as long again.)
        bound = 2 * self._checkouts.delay
        return await self._executions.claim(self._claim(key, args, token_hash), key, bound)

    async def _claim(self, key: RecordKey, args: tuple[Any, ...], token: bytes | None) -> Claim:
        locks = self._locks
        try:
            async with self._internal() as conn:
                if not locks.loaded:
                    await locks.load(conn)  # the store's `open` could not reach the server
                # (The key's claim lock: a transaction claiming the key holds it, see `claim`.)
                return await alone(claim, conn, key, args, token, None, locks.of(key), on=conn)
        except TRANSLATED as exc:
            raise translate(exc) from exc
        except LOCK_NOT_AVAILABLE as exc:  # (`claim` answers its NOWAIT locks busy itself)
            raise lock_waited(exc) from exc
        except SERVER_ERROR as exc:
            raise claim_refused(exc) from exc

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        # StoreClosed once closed, or in another loop than the pool's, or its pool (an app's,
        # given to the store) closed: renewals run on a connection of their own, and went on.
        if getattr(self.pool, "is_closing", bool)():  # (an asyncpg pool's; a wrapper's maybe)
            raise StoreClosed("the store's pool is closed")
        alive = await self._renewals.renew(
            bound(lease_seconds),
            key.tenant,
            key.operation,
            key.key,
            generation,
            lease_seconds,
        )
        return bool(alive)

    async def expire_lease(self, key: RecordKey, generation: int) -> bool:
        moved = await self._run_nowait(
            "fetchval",
            _Q["expire_lease"],
            key.tenant,
            key.operation,
            key.key,
            generation,
            notify_token(key),
        )
        return bool(moved)

    async def takeover(
        self, key: RecordKey, generation: int, expected: State, lease_seconds: float
    ) -> int | None:
        if expected not in (State.PENDING, State.UNKNOWN):
            # A finished outcome is replayed, never run again (docs/protocol.md).
            raise ValueError(f"only a pending or unknown record can be taken over, not {expected}")
        args = (key.tenant, key.operation, key.key, generation, expected.value, lease_seconds)
        taking = self._run_nowait("fetchval", _Q["takeover"], *args)
        # (To its end, and bounded: see there.)
        return await self._executions.take_over(taking, key, 2 * self._checkouts.delay)

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        row = await self._run_settling(
            "fetchrow", _Q["settle"], *settle_args(key, generation, expected, s)
        )
        return bool(row["settled"])

    async def release(self, key: RecordKey, generation: int) -> bool:
        row = await self._run_settling(
            "fetchrow", _Q["release"], *key, generation, notify_token(key)
        )
        return bool(row["released"])

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        args = (*key, generation, note, notify_token(key))
        row = await self._run_settling("fetchrow", _Q["allow_retry"], *args)
        return bool(row["moved"])

    def fenced(self, key: RecordKey, generation: int, expected: State = State.PENDING) -> Fencing:
        return Fencing(
            self.pool, self._checkouts, self._fast, key, generation, expected, self._clean_releases
        )

    async def _listen_connection(self) -> Any:
        """A connection of its own for LISTEN: to `listen_dsn`, else made as the pool makes its
        own (a pool given to the store too; `connect_kwargs` reach it)."""
        if not self._listen:
            raise StoreError("LISTEN is disabled for this store")
        if self._listen_dsn == self._dsn:  # (None for a pool given to the store)
            made = await compat.connect_like(self.pool, ".listen")
            if made is not None:
                return made
        if self._listen_dsn is None:
            raise StoreError("this asyncpg's pool does not say how it connects")
        return await asyncpg.connect(
            self._listen_dsn, server_settings={"application_name": "idem_middleware.listen"}
        )

    def _renewal_connection(self) -> Awaitable[Any]:
        return compat.connect_like(self.pool, ".renew")

    def watch(self, key: RecordKey) -> Any:
        return self._listener.watch(key)

    def _execute_statement(self, query: str, *args: Any) -> Awaitable[Any]:
        return self._run("execute", query, *args)


if TYPE_CHECKING:

    def _is_a_store(store: PostgresStore) -> Store:
        return store  # mypy checks here that PostgresStore implements the protocol
