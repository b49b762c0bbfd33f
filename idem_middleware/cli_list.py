"""`idem-middleware list`: records read page by page, and printed safely for a terminal.

The records of each state asked for are read a page at a time (`PostgresStore.list_page`, keyset
paging on updated_at and the key), each page a short statement of its own, and merged oldest
first as they are printed: memory stays a page per state whatever `--limit` is.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import deque
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

from .cli_connect import UsageError
from .cli_values import operation_hint
from .store.base import RecordSummary, State
from .store.postgres import PostgresStore

#: Records per page and state: about 1 KB each in memory, so a few MB a page. A page of a
#: finished state reads the table (no index orders them by age), so pages are not smaller:
#: 400,000 records listed in 11 s either way, in 61 MB instead of 417 MB.
PAGE_SIZE = 5000

#: An empty tenant shown: the anonymous tenant's name.
_EMPTY = '""'


def printable(text: str) -> str:
    """`text` with every character a terminal would not just show (controls such as ESC, which
    start escape sequences, bidirectional overrides, line separators, invisible spaces) written
    as Python writes it in a string's repr (`\\x1b`). Tenants, keys and notes are stored as
    clients and operators sent them; `--json` gives them exactly."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def field_value(text: str) -> str:
    """A value of `list`'s text output (`name=value` fields two spaces apart), `printable`, and
    quoted as a JSON string when it holds what would read as a field of its own: two spaces, an
    `=`, a leading `"` or surrounding spaces (a key `x  state=succeeded` showed a record's state
    twice, the forged one first)."""
    if "  " in text or "=" in text or text.startswith('"') or text != text.strip():
        return printable(json.dumps(text, ensure_ascii=False))
    return printable(text)


class _Pages:
    """One state's records, oldest first, a page at a time."""

    def __init__(self, store: PostgresStore, state: State, size: int, filters: dict[str, Any]):
        self._store = store
        self._state = state
        self._size = size
        self._filters = filters
        self._rows: deque[RecordSummary] = deque()
        self._until: datetime | None = None
        self._after: RecordSummary | None = None
        self._done = False

    async def next(self) -> RecordSummary | None:
        if not self._rows and not self._done:
            page, until = await self._store.list_page(
                self._state, size=self._size, until=self._until, after=self._after, **self._filters
            )
            self._until = self._until or until  # the first page's: later changes are left out
            self._done = len(page) < self._size
            self._rows.extend(page)
            self._after = page[-1] if page else None
        return self._rows.popleft() if self._rows else None


async def records(
    store: PostgresStore,
    *,
    states: Sequence[State],
    tenant: str | None = None,
    operation: str | None = None,
    stale_only: bool = False,
    limit: int,
    page_size: int = PAGE_SIZE,
) -> AsyncIterator[RecordSummary]:
    """At most `limit` records of `states`, oldest (updated_at) first: a record inserted or
    deleted meanwhile moves no other, and one changed after the listing began is left out (so
    one listed and then moved is not listed again), unless a transaction that began before the
    listing changed it (its `updated_at` is that transaction's start: docs/operating.md)."""
    filters = {"tenant": tenant, "operation": operation, "stale_only": stale_only}
    streams = [_Pages(store, s, min(page_size, limit), filters) for s in dict.fromkeys(states)]
    heads: list[tuple[datetime, int, RecordSummary]] = []
    for i, stream in enumerate(streams):
        first = await stream.next()
        if first is not None:
            heads.append((_age(first), i, first))
    heapq.heapify(heads)
    for listed in range(1, limit + 1):
        if not heads:
            return
        _, i, record = heapq.heappop(heads)
        yield record
        if listed < limit and (following := await streams[i].next()) is not None:
            heapq.heappush(heads, (_age(following), i, following))


def _age(rec: RecordSummary) -> datetime:
    """Where `rec` is merged: its updated_at, 'infinity' and '-infinity' too (which asyncpg
    gives as naive datetime.max and min: compared with another state's, a TypeError)."""
    at: datetime = rec.updated_at
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def row(rec: RecordSummary) -> dict[str, Any]:
    return {
        "tenant": rec.key.tenant,
        "operation": rec.key.operation,
        "key": rec.key.key,
        "state": rec.state.value,
        "generation": rec.generation,
        "mode": rec.mode,
        "updated_at": str(rec.updated_at),
        "lease_expired": rec.lease_expired,
        "response_status": rec.response_status,
        # The audit trail: one line per operator move (and the store's own notes), oldest first.
        "note": rec.note,
    }


async def list_records(store: PostgresStore, args: argparse.Namespace) -> int:
    states = args.state or ["pending", "unknown"]
    if args.stale and "pending" not in states:
        # --stale filters pending records only: with none asked for it changed nothing, and
        # `--stale --state succeeded` listed every succeeded record as if it had applied.
        raise UsageError(
            f"--stale keeps the pending records whose lease lapsed: it means nothing for "
            f"--state {' '.join(states)} (add --state pending, or leave --stale out)"
        )
    listed = 0
    async for rec in records(
        store,
        states=[State(v) for v in states],
        tenant=args.tenant,
        operation=args.operation,
        stale_only=args.stale,
        limit=args.limit,
    ):
        listed += 1
        fields = row(rec)
        if args.json:
            print(json.dumps(fields, sort_keys=True))
            continue
        # The audit trail's lines are joined so that one record stays one line.
        fields["note"] = None if rec.note is None else " | ".join(rec.note.splitlines())
        print("  ".join(f"{k}={field_value(str(v))}" for k, v in fields.items() if v is not None))
    if not listed and not args.json:
        where = "".join(
            f", {name} {printable(value) or _EMPTY}"
            for name, value in (("tenant", args.tenant), ("operation", args.operation))
            if value is not None
        )
        stale = "stale " if args.stale else ""
        hint = operation_hint(args.operation)
        print(f"no {stale}records in state {' or '.join(states)}{where}{hint}")
    return 0
