"""The outbox's and the inbox's statements run in the caller's own transaction, with its
writes: an event added, an event noted as consumed. Their errors are that transaction's, left to
the caller as asyncpg raised them (but an event that says something else: EventConflict)."""

from __future__ import annotations

from typing import Any

import asyncpg

from ...context import current_context
from ...errors import EventConflict, StoreError
from .convert import _Q, unsendable_text

#: How many times an event is added when the one it met is purged before it is compared.
_ADD_ATTEMPTS = 3


def _in_transaction(executor: Any, what: str) -> None:
    """TypeError unless `executor` is a connection in a transaction: on a pool, or a connection
    in autocommit, the note commits at once, whatever becomes of the consumer's own writes (an
    event noted as applied though it was not, and never applied)."""
    in_transaction = getattr(executor, "is_in_transaction", None)
    if not callable(in_transaction) or not in_transaction():
        raise TypeError(
            f"{what} runs on the connection of the caller's open transaction, with its writes, "
            f"not on a {type(executor).__name__}"
            + (" outside a transaction" if callable(in_transaction) else "")
        )


async def add_event(
    executor: Any, event_id: str, tenant: str | None, topic: str, payload: str
) -> None:
    """Write an outbox event (`payload` is JSON text) on the caller's connection. An event of
    the same id added before (by this transaction or a committed one) is left as it is when it
    says the same; EventConflict when it says something else. (One purged between the two
    statements is added again: bounded, as every loop.) Outside a transaction (a pool, a
    connection in autocommit) an event commits at once, a standalone event: TypeError if that
    is during an idempotent operation (a guarded request's handler, a job), where it was sent
    whatever became of the writes it announces (rolled back, or run again)."""
    if current_context() is not None:
        _in_transaction(executor, "add during an idempotent operation")
    for _ in range(_ADD_ATTEMPTS):
        try:
            if await executor.fetchval(_Q["outbox_add"], event_id, tenant, topic, payload):
                return
        except asyncpg.exceptions.DataError as exc:
            # (A payload the client encoding cannot carry: its text, which quoted the payload
            # (personal data, logged by the app), is replaced; the error is asyncpg's as before.)
            unsendable_text(exc)
            raise
        same = await executor.fetchval(_Q["outbox_same"], event_id, tenant, topic, payload)
        if same is not None:
            if not same:
                raise EventConflict(
                    f"outbox event {event_id!r} exists with another tenant, topic or payload"
                )
            return
    raise StoreError(f"outbox event {event_id!r} kept vanishing while it was added")


async def record_consumed(executor: Any, consumer: str, event_id: str) -> bool:
    """Note an event in the consumer's transaction: False if it was noted before."""
    _in_transaction(executor, "consume_once")
    return await executor.fetchval(_Q["inbox_record"], consumer, event_id) is not None
