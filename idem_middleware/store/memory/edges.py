"""The twin's operations off the request path: one-time tokens (the PostgreSQL store's
TokenIssuer writes them in SQL), and the operators' listing, amendments and purge."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime

from ..base import RecordKey, RecordSummary, Settlement, State, check_purge_limits
from .tables import MemoryTables, _summary, _Token


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
        """Record an issued token (the PostgreSQL store's TokenIssuer does this in SQL)."""
        expires_at = self.clock() + ttl_seconds
        self._tokens[(tenant, token_hash)] = _Token(operation, request_digest, expires_at)

    # -- operators -------------------------------------------------------------------------------

    async def amend(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        async with self._row_lock(key):
            row = self._current(key, generation, expected)
            if row is None:
                return False
            # The clock decides expiry; the audit trail shows wall time, as PostgreSQL's now().
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            line = f"{stamp} {s.note or ''}"
            self._settle_now(key, generation, expected, replace(s, note=None))
            row = self._rows[key]
            if s.state is State.PENDING:
                row = replace(row, generation=next(self._generations))
            self._rows[key] = replace(row, note=line if row.note is None else f"{row.note}\n{line}")
            return True

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
        found.sort(key=lambda r: r.updated_at)
        return found[:limit]

    async def purge(self, *, batch_size: int = 1000, max_batches: int = 1000) -> int:
        check_purge_limits(batch_size, max_batches)
        now = self.clock()
        doomed = [
            key
            for key, row in self._rows.items()
            if row.expires_at is not None and row.expires_at <= now and key not in self._owners
        ][: batch_size * max_batches]
        for key in doomed:
            del self._rows[key]
        # This store's tokens carry no intent, so none needs a tombstone once it has expired
        # (see queries.sql `purge_tokens`): an expired token is refused, a deleted one too.
        for token, found in list(self._tokens.items()):
            if found.expires_at <= now:
                del self._tokens[token]
        return len(doomed)
