"""The pool the outbox's and the inbox's functions take: checked before any statement."""

from __future__ import annotations

from typing import Any

from .store.postgres import PostgresStore
from .store.purge_limits import check_progress


def checked_store(pool: Any, caller: str = "outbox", progress: object = None) -> PostgresStore:
    """The store whose statements run on `pool` (an asyncpg pool; a PostgresStore is taken as it
    is). Anything else is a ValueError naming what it is, not the value (a DSN may hold a
    password): a DSN's str was an AttributeError from the store, and None "pass exactly one of
    pool= or dsn=", arguments the caller never used. So is a `progress` that is not a plain
    function: called after each batch, it failed after the first was deleted and committed (an
    async one was never run)."""
    check_progress(progress, caller)
    if isinstance(pool, PostgresStore):
        return pool
    if not callable(getattr(pool, "acquire", None)):
        what = "None" if pool is None else f"a value of type {type(pool).__name__}"
        hint = ": for a DSN, pass `await asyncpg.create_pool(dsn)`" if isinstance(pool, str) else ""
        raise ValueError(
            f"{caller}: the first argument is an asyncpg pool or a PostgresStore, not {what}{hint}"
        )
    return PostgresStore(pool=pool, listen=False)
