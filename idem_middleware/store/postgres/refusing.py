"""The outcome's record refused by the server, in words an operator can act on: what the
handler did in the claim's transaction, a constraint or trigger on the store's own table, or a
write of the store's that landed nowhere (convert.py: the driver's errors in general)."""

from __future__ import annotations

from typing import Any

import asyncpg

from ...errors import FencedSettlementRefused, SettlementRefused
from .convert import _Q, SERVER_ERROR, TRANSLATED, scrub, translate

#: The store's tables (its migrations'): an app's own may share their prefix (`idem_orders`).
STORE_TABLES = frozenset(
    [
        "idem_inbox",
        "idem_lock_secret",
        "idem_outbox",
        "idem_requests",
        "idem_schema_migrations",
        "idem_tokens",
        "idem_waiters",
    ]
)
#: What the names of the records' partitions start with (`idem_requests_h0`: docs/scaling.md).
RECORD_PARTITIONS = "idem_requests_"


async def read_only_cause(driver: Any, exc: BaseException) -> BaseException:
    """After a transactional completion refused as read-only (READ_ONLY) and its rollback: the
    server's doing (a standby, sessions that default to read-only: `translate`'s 503, for a
    retry later), or the handler's (`SET TRANSACTION READ ONLY`, which no retry clears:
    `refused`'s 500; taken for the server's, every retry ran the handler again and got the 503
    again). The server's, when it cannot tell (no connection to ask). (Lease mode needs no
    asking: its fence locked a row, which a read-only transaction cannot.)"""
    if driver is None:
        return translate(exc)
    try:
        row = await driver.fetchrow(_Q["writable"])
    except (*TRANSLATED, SERVER_ERROR):
        return translate(exc)
    if row["standby"] or row["read_only"]:
        return translate(exc)
    return refused(exc)


def write_refused(exc: BaseException) -> SettlementRefused:
    """A lease-mode outcome the store writes without a fence (settled, released, a retry
    allowed), refused by the server: no handler's statement ran in its transaction, so a
    constraint or trigger on the store's table refused the store's own write."""
    scrub(exc)
    return FencedSettlementRefused(
        f"the database refused the store's own write of the outcome ({type(exc).__name__}: "
        f"{exc}): a constraint or trigger on idem_requests refuses it (the store's tables take "
        "none that do); what the handler did outside the database may have happened"
    )


def skipped(what: str, fenced: bool = False) -> SettlementRefused:
    """The record of an outcome wrote nothing where the transaction holds the record (its own
    uncommitted row, or one it has locked): a trigger on the store's table skipped or changed
    the row (a BEFORE trigger that returns NULL), a rule, or the handler's own statement on it.
    Nothing committed; no retry clears it (it answered 503, and the fast path's record was
    never checked: the handler's writes committed without it, and every retry ran again)."""
    kind = FencedSettlementRefused if fenced else SettlementRefused
    return kind(
        f"{what}: a trigger or rule on idem_requests (or the handler) skipped or changed the "
        "store's own write; nothing of the transaction was committed. The store's tables take "
        "no triggers or rules that change its rows"
    )


def refused(exc: BaseException, fenced: bool = False, at_commit: bool = False) -> SettlementRefused:
    """The completion (or its COMMIT) refused by the server for what the handler did in the
    transaction, or by a constraint added to the store's own table: nothing committed, and the
    reason in words an operator can act on. (The DETAIL, which may quote a row, is dropped: see
    `convert.scrub`.) `fenced`: a lease-mode execution's settlement (its record is then marked
    `unknown`, not freed)."""
    scrub(exc)
    if fenced:
        kind: type[SettlementRefused] = FencedSettlementRefused
        transaction = "its fenced transaction"
        then = "the record is unknown (what the handler did outside the database may have happened)"
    else:
        kind, transaction, then = SettlementRefused, "the claim's transaction", "the key is free"
    if isinstance(exc, asyncpg.exceptions.InFailedSQLTransactionError):
        return kind(
            f"the handler answered after one of its statements failed, which aborted "
            f"{transaction}: nothing it wrote there was committed and no outcome was recorded "
            f"({then}). Put a statement that may fail in a savepoint (`async with "
            "conn.transaction():`, SQLAlchemy's `session.begin_nested()`), or raise, or answer "
            "with a status that releases the key (409, 422)"
        )
    table = getattr(exc, "table_name", None)
    if isinstance(table, str) and (table in STORE_TABLES or table.startswith(RECORD_PARTITIONS)):
        return kind(
            f"a constraint of the store's own table {table} refused the record of the handler's "
            f"outcome ({type(exc).__name__}: {exc}): nothing of {transaction} was committed "
            f"({then}). The store's tables keep the constraints its migrations made: a "
            "constraint or trigger added to them refuses the store's own writes"
        )
    if isinstance(exc, asyncpg.exceptions.IntegrityConstraintViolationError):
        return kind(
            f"the handler's writes broke a deferred constraint, checked when {transaction} "
            f"committed ({type(exc).__name__}: {exc}): nothing it wrote there was committed and "
            f"no outcome was recorded ({then}). Check it in the handler (`SET CONSTRAINTS ALL "
            "IMMEDIATE`) to answer the client yourself"
        )
    if at_commit:  # (the outcome's record was written: its COMMIT ran the deferred checks)
        return kind(
            f"a deferred trigger or constraint of the handler's writes refused {transaction} "
            f"at its COMMIT ({type(exc).__name__}: {exc}): nothing it wrote there was committed "
            f"and no outcome was recorded ({then}). Check it in the handler (`SET CONSTRAINTS "
            "ALL IMMEDIATE`) to answer the client yourself"
        )
    return kind(
        f"the database refused to record the handler's outcome ({type(exc).__name__}: {exc}): "
        f"nothing of {transaction} was committed ({then}). A handler must leave its connection "
        "able to reach the store's table: no SET ROLE to a role without its privileges, no "
        "search_path without its schema"
    )
