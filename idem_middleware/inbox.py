"""Consumers' inbox rows: what `outbox.consume_once` records, and their purge.

A consumer's `idem_inbox` row (consumer, event id, when it was recorded) is what makes a
redelivery of that event a no-op. `purge_inbox` deletes the rows recorded long enough ago, in
batches (`idem-middleware inbox purge` from cron). Purge a row only once its event can no longer
be delivered again: older than the producer's retention of sent events (`outbox purge
--older-than`) plus the longest a redelivery can take (a parked event requeued later is one), or
a late redelivery finds no row and is applied a second time. docs/tokens-and-outbox.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .outbox_values import seconds as _seconds
from .pool_arguments import checked_store as _store


async def purge_inbox(
    pool: Any,
    *,
    older_than_seconds: float,
    batch_size: int = 1000,
    max_batches: int = 1000,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete the inbox rows recorded more than `older_than_seconds` ago (a finite number from
    0: no default, it is yours to choose, see above), `batch_size` rows a short transaction,
    `max_batches` transactions at most (whole numbers from 1). Returns how many; `progress` is
    called with the count so far after each batch commits. `pool` is an asyncpg pool (or a
    PostgresStore). Anything else is a ValueError before any statement."""
    age = _seconds(older_than_seconds, "older_than_seconds", False)
    return await _store(pool, "purge_inbox", progress).inbox_purge(
        batch_size, age, max_batches, progress
    )
