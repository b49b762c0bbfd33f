"""The twin's operations off the request path: one-time tokens (issued as queries.sql
`issue_token` does, for a TokenIssuer, or recorded as they are by tests), and the operators'
listing, amendments and purge."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime

from ...errors import StatementRefused, StoreError
from ..base import (
    FINAL_STATES,
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
from .tables import MemoryTables, _Row, _summary, _Token

#: How long an operator's move waits for a transaction claiming the key (PostgreSQL's `amend`
#: waits for the row's lock at most 6 s, then is refused), in polls of 10 ms.
_OWNER_POLLS = 600
#: Why a move is refused past that wait (a StoreError, as the PostgreSQL store's refusal).
_WAITED_TOO_LONG = "waited longer than the lock_timeout for a row lock"


class OffPathOperations(MemoryTables):
    # -- one-time tokens -------------------------------------------------------------------------

    def add_token(
        self,
        tenant: str,
        token_hash: bytes,
        operation: str,
        *,
        ttl_seconds: float,
        request_digest: bytes | None = None,
    ) -> None:
        """Record an issued token as it is (a test's shortcut past `issue_token`)."""
        expires_at = self.clock() + ttl_seconds
        self._tokens[(tenant, token_hash)] = _Token(operation, request_digest, expires_at)

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
        """Issue a token, or return the one the intent holds, renewed if it expired unused (as
        queries.sql `issue_token`; TokenIssuer decides what a held token means). None while a
        transaction that consumes its expired token is open (PostgreSQL: its row is locked)."""
        intent = None if intent_id is None else (tenant, operation, intent_id)
        held = None if intent is None else self._intents.get(intent)
        if (
            held is not None
            and (tenant, held) in self._held_tokens
            and self._tokens[(tenant, held)].expires_at <= self.clock()
        ):
            return None
        now = self.clock()
        expires_at = now + ttl_seconds
        if held is not None:
            token = self._tokens[(tenant, held)]
            if token.expires_at <= now and not token.consumed:
                token = self._tokens[(tenant, held)] = replace(token, expires_at=expires_at)
            spent = token.consumed and token.expires_at <= now
            return TokenRow(held, _timestamp(token.expires_at), token.request_digest, spent)
        if (tenant, token_hash) in self._tokens:  # the primary key
            raise StatementRefused("UniqueViolationError: idem_tokens_pkey")
        fresh = _Token(operation, request_digest, expires_at, intent_id=intent_id)
        self._tokens[(tenant, token_hash)] = fresh
        if intent is not None:
            self._intents[intent] = token_hash
        return TokenRow(token_hash, _timestamp(expires_at), request_digest, False)

    # -- operators -------------------------------------------------------------------------------

    async def amend(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        held = key in self._fence_locks or key in self._owners
        if held and self._amendable(key, generation, expected) is None:
            return False  # a row it does not match is never waited for, as on PostgreSQL
        # A transaction claiming the key again (its retention over) holds its row until it
        # ends, as on PostgreSQL: waited for, then the row is judged as it is now (taken over:
        # refused). Not waited for, the operator was told the move was made, and the claim's
        # outcome then replaced it.
        for _ in range(_OWNER_POLLS):
            if key not in self._owners:
                break
            await asyncio.sleep(0.01)
        else:
            raise StoreError(_WAITED_TOO_LONG)  # (as PG's)
        try:
            # A fenced session's row lock, waited for as long as the owner above (lock_timeout).
            async with asyncio.timeout(_OWNER_POLLS / 100), self._row_lock(key):
                if self._amendable(key, generation, expected) is None:
                    return False  # (a lease renewed since it was read: as the SQL's)
                self._settle_now(key, generation, expected, s)
                # (As the SQL's: every move, a reopen's too, takes a new generation. A move with
                # no note appends no line: concat_ws skips a NULL, and makes a NULL trail "".)
                moved = self._rows[key]
                note = moved.note or ""
                new = next(self._generations)
                reopened = new if s.state is State.UNKNOWN and expected in FINAL_STATES else None
                self._rows[key] = replace(
                    moved, generation=new, note=note, reopened_generation=reopened
                )
                return True
        except TimeoutError:  # (only the wait: nothing above it awaits)
            raise StoreError(_WAITED_TOO_LONG) from None

    def _amendable(self, key: RecordKey, generation: int, expected: State) -> _Row | None:
        """The row `amend` moves: in `expected` under `generation`, and a pending lease-mode
        record only with its lease lapsed (renewed, an execution still runs it) or released for
        a retry (no lease)."""
        row = self._current(key, generation, expected)
        if row is None or (
            row.state is State.PENDING
            and row.mode == "lease"
            and row.lease_expires_at is not None
            and row.lease_expires_at > self.clock()
        ):
            return None
        return row

    async def peek(self, key: RecordKey) -> tuple[Record | None, bool]:
        row = self._rows.get(key)
        record = None if row is None else row.record(key, self.clock())
        # (A transaction claiming the key: its record is staged, seen by nobody else yet.)
        return record, (record is None or record.expired) and key in self._owners

    async def describe(self, key: RecordKey) -> RecordSummary | None:
        row = self._rows.get(key)
        return None if row is None else _summary(key, row, self.clock())

    async def list_records(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        operation: str | None = None,
        limit: int = 100,
        stale_only: bool = False,
    ) -> list[RecordSummary]:
        states = checked_listing(states, tenant, operation, limit)  # (as PostgreSQL's)
        now = self.clock()
        found = []
        for key, row in self._rows.items():
            if row.state not in states or tenant not in (None, key.tenant):
                continue
            if operation not in (None, key.operation):
                continue
            lapsed = row.lease_expires_at is None or row.lease_expires_at <= now
            if stale_only and row.state is State.PENDING and not lapsed:
                continue
            found.append(_summary(key, row, now))
        # As queries.sql orders them: an unknown record `reconcile` asked about under its
        # generation after those it has not, those asked longest ago first.
        asked = self._asked
        for stale in [k for k, (g, _) in asked.items() if not self._current(k, g, State.UNKNOWN)]:
            del asked[stale]  # (moved since: the stamp no longer counts)

        def order(r: RecordSummary) -> tuple[bool, float, float, RecordKey]:
            at = asked[r.key][1] if r.key in asked else None
            return (at is not None, at or 0.0, r.updated_at, r.key)

        found.sort(key=order)
        return found[:limit]

    async def mark_asked(self, key: RecordKey, generation: int) -> bool:
        """As queries.sql `mark_asked`: a row a session holds is left unstamped."""
        if self._current(key, generation, State.UNKNOWN) is None or key in self._fence_locks:
            return False
        self._asked[key] = (generation, self.clock())
        return True

    async def stats(self, *, unresolved_only: bool = False) -> StoreStats:
        """As the PostgreSQL store counts: every row (expired ones not yet purged too), or the
        pending and unknown ones alone."""
        now = self.clock()
        states = UNRESOLVED_STATES if unresolved_only else tuple(State)
        counts = {state.value: 0 for state in states}
        oldest: dict[str, float | None] = {state.value: None for state in states}
        lapsed = 0
        for _, row in self._rows.items():
            if row.state not in states:
                continue
            counts[row.state.value] += 1
            age = now - row.updated_at
            seen = oldest[row.state.value]
            oldest[row.state.value] = age if seen is None else max(seen, age)
            if row.lease_expires_at is not None and row.lease_expires_at <= now:
                lapsed += 1  # (only a pending record has a lease)
        return StoreStats(counts=counts, oldest_age_seconds=oldest, lapsed_leases=lapsed)

    async def purge(
        self,
        *,
        batch_size: int = 1000,
        max_batches: int = 1000,
        progress: Callable[[int], None] | None = None,
        on_limit: Callable[[str], None] | None = None,
    ) -> int:
        check_purge_limits(batch_size, max_batches)
        check_progress(progress)
        check_on_limit(on_limit)
        now = self.clock()
        most = batch_size * max_batches  # (each pass as many as PostgreSQL's batches delete)
        expired = [
            (row.expires_at, key)
            for key, row in self._rows.items()
            if row.expires_at is not None and row.expires_at <= now and key not in self._owners
        ]
        doomed = [key for _, key in sorted(expired)[:most]]  # (oldest first)
        for key in doomed:
            del self._rows[key]
        # The consumed tokens of intents stay as tombstones (see queries.sql `purge_tokens`).
        spent = [
            (found.expires_at, token)
            for token, found in self._tokens.items()
            if found.expires_at <= now
            and not (found.consumed and found.intent_id is not None)
            and token not in self._held_tokens  # (a claim holds its row: skipped, as SKIP LOCKED)
        ]
        for _, token in sorted(spent)[:most]:
            found = self._tokens.pop(token)
            if found.intent_id is not None:
                del self._intents[(token[0], found.operation, found.intent_id)]
        if on_limit is not None and len(spent) >= most:  # (every batch full: as PostgreSQL's)
            on_limit("tokens")
        if progress is not None:
            progress(len(doomed))
        return len(doomed)


def _timestamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
