"""The store's statements off the request path: token issuance and the outbox (SQL runs only
in the store, not in tokens.py or outbox.py), and the operators' listing, purge and stats.
Each translates driver errors into the library's (StoreError: a lost connection or none;
RetryableConflict: a serialization failure or deadlock; StatementRefused: a statement refused
on a usable connection). The statements run in the caller's own transaction are in
`events.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from ..base import (
    UNRESOLVED_STATES,
    Record,
    RecordKey,
    RecordSummary,
    Settlement,
    State,
    StoreStats,
    TokenRow,
)
from ..listing import checked_listing
from ..purge_limits import check_on_limit, check_progress, check_purge_limits
from .claim_lock import ClaimLocks
from .convert import (
    _Q,
    ACQUIRE_ERRORS,
    LOCK_NOT_AVAILABLE,
    READ_TRANSLATED,
    SERVER_ERROR,
    TRANSLATED,
    lock_waited,
    no_connection,
    translate,
)
from .privileges import require_outbox_visible
from .rows import settle_args, to_record
from .runner import PoolStatements, alone, checkout


def _summary(r: Any) -> RecordSummary:
    return RecordSummary(
        key=RecordKey(r["tenant"], r["operation"], r["idem_key"]),
        state=State(r["state"]),
        generation=r["generation"],
        mode=r["mode"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        lease_expires_at=r["lease_expires_at"],
        expires_at=r["expires_at"],
        response_status=r["response_status"],
        note=r["note"],
        lease_expired=bool(r["lease_expired"]),
        epoch=r["epoch"],
        reopened=r["reopened"],
    )


@dataclass(frozen=True, slots=True)
class ReservedEvent:
    """An outbox event reserved for one send; `attempts` counts this one."""

    event_id: str
    tenant: str | None
    topic: str
    payload: str
    attempts: int
    parked: bool


class OutboxConnection:
    """One pooled connection for a publisher's batch: reserve, then mark each send's result."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def _call(self, method: str, query: str, *args: Any) -> Any:
        # Each statement commits on its own: one refused for a serialization failure (another
        # publisher's reservation, under a REPEATABLE READ or SERIALIZABLE default) changed
        # nothing and runs again, rather than failing the batch into the publisher's backoff.
        try:
            return await alone(getattr(self._conn, method), query, *args, on=self._conn)
        except (*TRANSLATED, SERVER_ERROR) as exc:
            raise translate(exc) from exc

    async def reserve(self, reservation_seconds: float, max_attempts: int) -> ReservedEvent | None:
        row = await self._call("fetchrow", _Q["outbox_claim"], reservation_seconds, max_attempts)
        if row is None:
            return None
        return ReservedEvent(
            row["event_id"],
            row["tenant"],
            row["topic"],
            row["payload"],
            row["attempts"],
            row["parked"],
        )

    async def mark_sent(self, event_id: str) -> None:
        await self._call("execute", _Q["outbox_sent"], event_id)

    async def mark_failed(
        self, event_id: str, error: str, backoff_seconds: float, max_attempts: int, attempt: int
    ) -> None:
        await self._call(
            "execute",
            _Q["outbox_failed"],
            event_id,
            error,
            backoff_seconds,
            max_attempts,
            attempt,
        )


class OffPathStatements(PoolStatements):
    """The statements off the request path: tokens, the outbox, operators' tools, the status
    resource's read."""

    _locks: ClaimLocks  # (the store's: computes each key's claim lock)
    #: Whether this store's role was found to see the whole outbox (its first publisher batch).
    _outbox_visible: bool = False

    async def issue_token(
        self,
        tenant: str,
        token_hash: bytes,
        operation: str,
        *,
        request_digest: bytes | None,
        intent_id: str | None,
        ttl_seconds: float,
    ) -> TokenRow | None:
        """The intent's token (see queries.sql `issue_token`); None while a transaction that
        consumes its expired token runs (the caller asks again, with no connection held)."""
        row = await self._run_any(
            "fetchrow",
            _Q["issue_token"],
            tenant,
            token_hash,
            operation,
            request_digest,
            intent_id,
            ttl_seconds,
        )
        if row["busy"]:
            return None
        digest = row["request_digest"]
        return TokenRow(
            bytes(row["token_hash"]),
            row["expires_at"],
            None if digest is None else bytes(digest),
            bool(row["spent"]),
        )

    @asynccontextmanager
    async def outbox_connection(self) -> AsyncIterator[OutboxConnection]:
        try:
            conn = await checkout(self.pool, self._checkouts)
        except ACQUIRE_ERRORS as exc:
            raise translate(exc) from exc
        try:
            if not self._outbox_visible:  # (once per store: see require_outbox_visible)
                await require_outbox_visible(conn)
                self._outbox_visible = True
            yield OutboxConnection(conn)
        finally:
            await self.pool.release(conn)

    async def outbox_stats(self) -> dict[str, Any]:
        return dict(await self._run_any("fetchrow", _Q["outbox_stats"]))

    async def outbox_events(self, *, parked_only: bool, limit: int) -> list[dict[str, Any]]:
        if type(limit) is not int or not 0 <= limit < 2**63:  # (as list_records': not the
            # server's raw error, nor every event for None; a LIMIT is a bigint)
            raise ValueError(f"list_events: limit must be a whole number from 0, not {limit!r}")
        rows = await self._run_any("fetch", _Q["outbox_list"], parked_only, limit)
        return [dict(r) for r in rows]

    async def outbox_requeue(self, event_ids: Sequence[str]) -> dict[str, str]:
        """Each id asked for (once, in order): requeued, unknown, unsent or sent."""
        rows = await self._run_any("fetch", _Q["outbox_requeue"], list(dict.fromkeys(event_ids)))
        return {row["event_id"]: row["outcome"] for row in rows}

    def outbox_purge(
        self,
        batch_size: int,
        older_than_seconds: float,
        max_batches: int = 10_000,
        progress: Callable[[int], None] | None = None,
    ) -> Awaitable[int]:
        """Delete the events sent more than `older_than_seconds` ago (`_aged_purge`). A batch
        size of 0 ran 10,000 empty statements before it was refused, a negative one was a LIMIT
        the server refused."""
        return self._aged_purge(
            _Q["outbox_purge"], older_than_seconds, batch_size, max_batches, progress
        )

    def inbox_purge(
        self,
        batch_size: int,
        older_than_seconds: float,
        max_batches: int,
        progress: Callable[[int], None] | None = None,
    ) -> Awaitable[int]:
        """Delete consumers' inbox rows recorded more than `older_than_seconds` ago
        (`_aged_purge`)."""
        return self._aged_purge(
            _Q["inbox_purge"], older_than_seconds, batch_size, max_batches, progress
        )

    async def _aged_purge(
        self,
        query: str,
        older_than_seconds: float,
        batch_size: int,
        max_batches: int,
        progress: Callable[[int], None] | None,
    ) -> int:
        """The delete `query` (rows older than `older_than_seconds`), a batch a statement,
        `max_batches` at most: how many it deleted (`progress` as `purge`'s). Counts that are no
        whole numbers from 1 are refused (ValueError) before any statement; a server's error is
        the store's (as `_run_any`'s: the outbox's callers expect no driver error)."""
        check_purge_limits(batch_size, max_batches)
        try:
            return await self._purge_batches(
                query, batch_size, max_batches, progress, (older_than_seconds,), keyset=True
            )
        except SERVER_ERROR as exc:
            raise translate(exc) from exc

    async def list_records(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        operation: str | None = None,
        limit: int = 100,
        stale_only: bool = False,
    ) -> list[RecordSummary]:
        states = checked_listing(states, tenant, operation, limit)
        args = ([s.value for s in states], tenant, operation, limit, stale_only)
        rows = await self._run("fetch", _Q["list_records"], *args)
        return [_summary(r) for r in rows]

    async def mark_asked(self, key: RecordKey, generation: int) -> bool:
        """See queries.sql `mark_asked` (never waits for the record's row lock)."""
        return bool(await self._run("fetchval", _Q["mark_asked"], *key, generation))

    async def list_page(
        self,
        state: State,
        *,
        tenant: str | None,
        operation: str | None,
        stale_only: bool,
        size: int,
        until: datetime | None,
        after: RecordSummary | None,
    ) -> tuple[list[RecordSummary], datetime | None]:
        """One page of `state`'s records, oldest first, after the record `after` (None: the
        first page), changed at `until` at the latest (None: now). Returns the page and the
        bound to pass as `until` for the next (None when the page is empty). See queries.sql
        `list_page`; `listing.records` walks them."""
        cursor = (None,) * 4 if after is None else (after.updated_at, *after.key)
        rows = await self._run(
            "fetch",
            _Q["list_page"],
            state.value,
            tenant,
            operation,
            size,
            stale_only,
            until,
            *cursor,
        )
        return [_summary(r) for r in rows], rows[0]["listed_at"] if rows else None

    async def amend(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        """An operator's move (see queries.sql `amend`): a settle whose note joins the trail."""
        row = await self._run("fetchrow", _Q["amend"], *settle_args(key, generation, expected, s))
        return bool(row["amended"])

    async def peek(self, key: RecordKey) -> tuple[Record | None, bool | None]:
        """See queries.sql `peek`: one statement, which writes and locks nothing. A role that
        may not read pg_locks reads the record alone (`get`), and `claiming` is then None
        (cannot tell) where there is no live record."""
        locks = self._locks
        try:
            async with self._internal() as conn:
                if not locks.loaded:
                    await locks.load(conn)  # the store's `open` could not reach the server
                names = (key.tenant, key.operation, key.key)
                if locks.readable:
                    try:
                        row = await alone(conn.fetchrow, _Q["peek"], *names, locks.of(key), on=conn)
                    except asyncpg.InsufficientPrivilegeError:  # (revoked since the open)
                        locks.unreadable(await conn.fetchval("SELECT quote_ident(current_user)"))
                    else:
                        record = None if row["found"] is None else to_record(key, row)
                        return record, bool(row["claiming"])
                got = await alone(conn.fetchrow, _Q["get"], *names, on=conn)
        except ACQUIRE_ERRORS as exc:
            raise no_connection(exc) from exc
        except READ_TRANSLATED as exc:  # (a tenant the client encoding cannot carry too)
            raise translate(exc) from exc
        except LOCK_NOT_AVAILABLE as exc:  # (the role's lock_timeout, behind a migration's lock)
            raise lock_waited(exc) from exc
        record = None if got is None else to_record(key, got)
        return record, None if record is None or record.expired else False

    async def describe(self, key: RecordKey) -> RecordSummary | None:
        row = await self._run("fetchrow", _Q["describe"], key.tenant, key.operation, key.key)
        return None if row is None else _summary(row)

    async def purge(
        self,
        *,
        batch_size: int = 1000,
        max_batches: int = 1000,
        progress: Callable[[int], None] | None = None,
        on_limit: Callable[[str], None] | None = None,
    ) -> int:
        """Delete finished records past their retention, one short transaction per batch, and
        then expired one-time tokens and waits left behind by dead processes the same way.

        Never touches pending or unknown records. Returns how many records were deleted;
        `progress` is called with the count so far after each batch of records commits, so a
        caller that the database fails partway (StoreError) still knows what was done;
        `on_limit` with "tokens" or "waiters" when their batches stopped at `max_batches`."""
        check_purge_limits(batch_size, max_batches)
        check_progress(progress)
        check_on_limit(on_limit)
        deleted = await self._purge_batches(
            _Q["purge_batch"], batch_size, max_batches, progress, keyset=True
        )
        # (The waiters' purge is no keyset: a few rows a dead process left, unordered.)
        for what, query, keyset in (
            ("tokens", _Q["purge_tokens"], True),
            ("waiters", _Q["purge_waiters"], False),
        ):
            others = await self._purge_batches(query, batch_size, max_batches, keyset=keyset)
            if on_limit is not None and others == batch_size * max_batches:
                on_limit(what)
        return deleted

    async def _purge_batches(
        self,
        query: str,
        batch_size: int,
        max_batches: int,
        progress: Callable[[int], None] | None = None,
        args: tuple[Any, ...] = (),
        keyset: bool = False,
    ) -> int:
        """`query` (its $1 the batch size, then `args`) run until a batch deletes fewer than
        `batch_size` rows, `max_batches` times at most: how many it deleted. `keyset`: its last
        argument is where the batch before ended, the largest of the values it returned."""
        deleted, after = 0, None
        for _ in range(max_batches):
            if keyset:
                rows = await self._run("fetch", query, batch_size, *args, after)
                ended = [row[0] for row in rows]
                count, after = len(ended), max(ended, default=after)
            else:
                status = await self._run("execute", query, batch_size, *args)
                count = int(status.rsplit(" ", 1)[-1])
            deleted += count
            if progress is not None:
                progress(deleted)
            if count < batch_size:
                break
        return deleted

    async def stats(self, *, unresolved_only: bool = False) -> StoreStats:
        """Counts per state. The full count reads the whole table (a parallel scan: 0.45 s on 2
        million records, and proportional beyond); `unresolved_only` counts pending and unknown
        records from their partial index, milliseconds whatever the table's size."""
        query = _Q["stats_unresolved"] if unresolved_only else _Q["stats"]
        try:
            rows = await self.pool.fetch(query)
        except ACQUIRE_ERRORS as exc:
            raise no_connection(exc) from exc
        states = UNRESOLVED_STATES if unresolved_only else tuple(State)
        counts = {state.value: 0 for state in states}
        oldest: dict[str, float | None] = {state.value: None for state in states}
        for row in rows:
            counts[row["state"]] = row["count"]
            oldest[row["state"]] = row["oldest_age_seconds"]
        lapsed = sum(row["lapsed"] for row in rows if row["state"] == State.PENDING.value)
        return StoreStats(counts=counts, oldest_age_seconds=oldest, lapsed_leases=lapsed)
