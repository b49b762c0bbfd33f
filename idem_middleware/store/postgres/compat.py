"""Everything that touches asyncpg's private attributes, in one place.

asyncpg keeps no public way to say "this connection's transaction is yours" (the fast path sends
its own BEGIN and COMMIT), to reach the connection behind a pool's proxy, or to prepare through
the connection's statement cache, or to open a connection as a pool does (lease renewals' own,
see renewals.py). `supported` checks that what this module relies on exists;
tests/integration/test_fused.py fails if a new asyncpg changes it.
"""

from __future__ import annotations

import functools
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import asyncpg
from asyncpg.transaction import TransactionState

if TYPE_CHECKING:
    AnyPool = asyncpg.Pool[Any]
else:  # (asyncpg's Pool is generic to type checkers alone: hints resolved at run time read this)
    AnyPool = asyncpg.Pool


def supported(conn: Any) -> bool:
    """Whether `adopt` and `committed` can work on this connection (a proxy of a pool's
    connection forwards `_top_xact`)."""
    return hasattr(conn, "_top_xact") and getattr(TransactionState, "STARTED", None) is not None


def adopt(conn: Any) -> Any:
    """An asyncpg Transaction standing for a BEGIN we send ourselves. Without it a handler's
    `conn.transaction()` would refuse to run inside a manually started transaction; with it,
    that nests as a savepoint."""
    tx = conn.transaction()  # on a pool's proxy, bound to the connection behind it
    tx._state = TransactionState.STARTED
    tx._connection._top_xact = tx
    return tx


def committed(tx: Any) -> None:
    """Record with asyncpg that a transaction was committed by a COMMIT we sent ourselves."""
    tx._state = TransactionState.COMMITTED
    if tx._connection._top_xact is tx:
        tx._connection._top_xact = None


def raw_connection(conn: Any) -> Any:
    """The connection behind a pool's proxy (None once released), or `conn` itself when it is
    not a proxy. Pools hand out a new proxy per acquisition: state kept per connection keys on
    this."""
    return getattr(conn, "_con", conn)


#: What asyncpg's reset keeps and the store's pool resets too (after asyncpg's own `RESET ALL`,
#: which never resets the role): the role (a handler's `SET ROLE` or `SET SESSION
#: AUTHORIZATION`; back to the one the connection opened with), its temporary tables and its
#: sequences' `currval`/`lastval`. Each would reach the next request, another tenant's.
_RESET_MORE = ";\nRESET SESSION AUTHORIZATION;\nRESET ROLE;\nDISCARD TEMP;\nDISCARD SEQUENCES;"


def reset_query(conn: Any) -> str:
    """The reset of a connection a handler had: asyncpg's (`get_reset_query`), and what it keeps
    (`_RESET_MORE`). Empty where asyncpg's is (a server that does not take a reset)."""
    return _with_more(conn.get_reset_query())


@functools.lru_cache(maxsize=8)
def _with_more(query: str) -> str:
    # (asyncpg's query is the same text for every connection: built once, not per release)
    return query + _RESET_MORE if query else ""


def release_unshielded(pool: Any, conn: Any) -> Coroutine[Any, Any, None] | None:
    """`pool.release(conn)` without the task asyncpg's release makes for it (`asyncio.shield`),
    for a connection whose return sends nothing (not in a transaction, its reset the store's
    own, skipped for a clean one): then nothing in it waits, so no cancellation can stop it
    half-way, and the shield guarded nothing at the cost of a task per release. (Should it wait
    after all, a connection the pool closes instead, past its `max_queries`: a cancellation
    then terminates it, and the pool opens another.) None: `conn` is not `pool`'s proxy as this
    asyncpg makes them (released the ordinary way then)."""
    try:  # (attributes read directly: a `getattr` and a `callable` each cost more, per request)
        holder, raw = conn._holder, conn._con
        if raw is None or holder._pool is not pool:
            return None
        check, tidy, release = pool._check_init, raw._on_release, holder.release
        timeout = holder._timeout
    except AttributeError:
        return None  # (an asyncpg that keeps them elsewhere: its own release, task and all)
    check()  # (raises if the pool is closed)
    tidy()
    coroutine: Coroutine[Any, Any, None] = release(timeout)
    return coroutine


async def prepare_cached(
    conn: Any,
    query: str,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> Any:
    """A PreparedStatement from the connection's own statement cache (the one `fetch` uses,
    which follows `statement_cache_size`), where `conn.prepare` would make a new one."""
    return await conn._prepare(query, timeout=timeout, use_cache=True)


def forget_statements(conn: Any) -> None:
    """Empty asyncpg's cache of prepared statements on the connection behind `conn` (None, or
    given back: nothing). For a session whose statements are gone although asyncpg still names
    them (a handler's `DEALLOCATE ALL`): each of them would fail, on every later use of the
    connection, with "prepared statement ... does not exist". (What `reload_schema_state`
    does for every connection of a pool, for one.)"""
    raw = raw_connection(conn)
    drop = getattr(raw, "_drop_local_statement_cache", None)
    if callable(drop):
        drop()


def statement_cache_size(conn: Any) -> int | None:
    """How many prepared statements the connection behind `conn` caches (its
    `statement_cache_size`); None if this asyncpg keeps it elsewhere."""
    cache = getattr(raw_connection(conn), "_stmt_cache", None)
    size = getattr(cache, "get_max_size", None)
    return size() if callable(size) else None


async def connect_like(pool: Any, suffix: str) -> Any:
    """A new connection made as `pool` makes its own (asyncpg's `Pool._get_new_connection`: its
    connect arguments, `connect=` callback, connection and record classes, then its `init`
    callback), and its `setup` callback run on it once, outside the pool; its application_name
    the pool's (else "idem_middleware") and `suffix`. None if this asyncpg keeps them elsewhere."""
    try:
        connect, args, kwargs = pool._connect, pool._connect_args, dict(pool._connect_kwargs)
        classes = {"connection_class": pool._connection_class, "record_class": pool._record_class}
        callbacks, loop = (pool._init, pool._setup), pool._loop
    except AttributeError:
        return None
    settings = dict(kwargs.get("server_settings") or {})
    settings["application_name"] = settings.get("application_name", "idem_middleware") + suffix
    kwargs["server_settings"] = settings
    conn = await connect(*args, loop=loop, **classes, **kwargs)
    try:
        for callback in callbacks:
            if callback is not None:
                await callback(conn)
    except BaseException:
        conn.terminate()
        raise
    return conn
