"""A pooler in transaction mode in front of a pool whose connections cache prepared statements.

asyncpg names the statements it caches per client connection (`__asyncpg_stmt_1__`, ...).
PgBouncer in transaction pooling mode hands each transaction of a client connection to whichever
server session is free: a cached statement is then missing ("prepared statement ... does not
exist"), or another client's of the same name is there ("already exists"). Through PgBouncer
1.18 with the default `statement_cache_size=100`, about a third of concurrent requests failed
so, each a plain 500, the rest passing. `check` finds it when the store opens.

The evidence is the failure itself, so nothing else is refused: two of the pool's connections
prepare a statement of one fresh name, one after the other. Directly, or through a pooler in
session mode (each client connection keeps its server session), both succeed; so they do through
a pooler that tracks prepared statements (PgBouncer 1.21 and later with
`max_prepared_statements`), which renames them per server session. Only when the two connections
share a server session whose names are the clients' own does the second fail. Under load the
pooler may hand the second connection another session; the test is then inconclusive, and the
store opens as before.

A pooler in statement mode (PgBouncer's `pool_mode = statement`) hands out a server session per
statement and closes a client connection that leaves a transaction open at the end of one:
every transactional claim and lease-mode fence then failed, each request answered 503, while
the store opened without a word. `require_transactions` opens one when the store opens.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import asyncpg

from ...errors import ConfigurationError
from . import compat
from .convert import CONNECTION_ERRORS

#: What a client connection's prepared statement meets on a server session it does not own.
PREPARED_MISMATCH: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InvalidSQLStatementNameError,
    asyncpg.exceptions.DuplicatePreparedStatementError,
)

#: What PgBouncer in statement mode says when a client connection opens a transaction.
_STATEMENT_MODE = "statement pooling mode"

#: How many pairs of statements are tried (each pair: two round trips).
_ROUNDS = 3


def refusal(cache_size: int | None, cause: BaseException | None = None) -> ConfigurationError:
    # (The server's message alone: asyncpg appends a page of advice to these errors.)
    seen = f" ({getattr(cause, 'message', cause)})" if cause is not None else ""
    return ConfigurationError(
        "the store's connections go through a pooler in transaction mode (PgBouncer's "
        "pool_mode = transaction) that shares server sessions between them, and asyncpg "
        f"caches prepared statements on them (statement_cache_size={cache_size}): requests "
        "would fail at random with 'prepared statement \"__asyncpg_stmt_...\" does not exist' "
        f"or 'already exists'{seen}. Pass statement_cache_size=0 (to PostgresStore, or to "
        "the asyncpg pool given to it), or let the pooler track prepared statements "
        "(PgBouncer 1.21 or later: max_prepared_statements > 0)"
    )


async def check(pool: Any, timeout: float) -> None:  # noqa: ASYNC109 - asyncpg's acquire
    """ConfigurationError if the pool's connections cache prepared statements and two of them
    are seen sharing a server session that does not keep their statements apart."""
    if pool.get_max_size() < 2:
        return  # (two connections at once would wait for each other)
    async with pool.acquire(timeout=timeout) as first, pool.acquire(timeout=timeout) as second:
        cache_size = compat.statement_cache_size(first)
        if not cache_size:
            return
        for _ in range(_ROUNDS):
            name = f"idem_pooler_probe_{uuid.uuid4().hex}"
            await first.prepare("SELECT 1", name=name)
            try:
                await second.prepare("SELECT 1", name=name)
            except asyncpg.exceptions.DuplicatePreparedStatementError as exc:
                raise refusal(cache_size, exc) from exc
            finally:
                # (Not there: the other connection's session had it, or it was never made.)
                for conn in (first, second):
                    with contextlib.suppress(asyncpg.exceptions.InvalidSQLStatementNameError):
                        await conn.execute(f"DEALLOCATE {name}")


async def require_sessions_to_listen(pool: Any, timeout: float) -> None:  # noqa: ASYNC109
    """ConfigurationError if two of the pool's connections, both held, are answered by one
    server session: a pooler in transaction mode is in between, and a LISTEN there lands on
    whichever server session is free (its notifications reach no one). PostgreSQL never gives
    two open connections one backend; a busy pooler may give them two: then nothing is seen."""
    if pool.get_max_size() < 2:
        return
    async with pool.acquire(timeout=timeout) as first, pool.acquire(timeout=timeout) as second:
        for _ in range(_ROUNDS):
            pid = await first.fetchval("SELECT pg_backend_pid()")
            if await second.fetchval("SELECT pg_backend_pid()") != pid:
                continue
            raise ConfigurationError(
                "the store listens for notifications (listen=True, the default) through a "
                "pooler in transaction mode (PgBouncer's pool_mode = transaction): two of its "
                f"connections were answered by one server session (backend {pid}), so its "
                "LISTEN would land on whichever session is free and no waiter would ever be "
                "woken by a notification (each settlement still sending one). Pass "
                "listen=False (lease-mode waiters poll, 50 ms doubling to 1 s), or listen_dsn= "
                "a direct connection to PostgreSQL"
            )


async def require_transactions(conn: Any) -> None:
    """ConfigurationError if the connection cannot keep a transaction open from one statement
    to the next (a pooler in statement mode closes it at the BEGIN, saying why)."""
    tx = conn.transaction()
    try:
        await tx.start()
    except CONNECTION_ERRORS as exc:
        # (The connection is gone; the pooler's own words come as the cause. PgBouncer says
        # other things with the same code: that it cannot log in to the server, say, while it
        # restarts, which is no reason to refuse the store.)
        said = exc.__cause__
        if not isinstance(said, asyncpg.exceptions.ProtocolViolationError) or (
            _STATEMENT_MODE not in str(getattr(said, "message", None) or said)
        ):
            raise
        raise ConfigurationError(
            "the store's connections cannot hold a transaction open "
            f"({getattr(said, 'message', said)}): a pooler in statement mode (PgBouncer's "
            "pool_mode = statement) refuses what every transactional claim and lease-mode fence "
            "needs. Use pool_mode = transaction (or session) for the store's database"
        ) from exc
    await tx.rollback()
