"""An operator's audit note is at most `MAX_NOTE_CHARS` (1,000) characters, counted as it is
kept (its whitespace runs as one space): `ops.resolve` and `ops.reopen` raise ValueError, the
CLI exits 2 naming the bound, and the record is left as it was.

Found by an earlier hunt: a 2 MB note was accepted and kept in the audit trail, which `show`
and `list` print whole, for the record's whole retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idem_middleware import MemoryStore, ops
from idem_middleware.ops import Resolution, reopen, resolve
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from tests.integration.test_cli import cli, insert

KEY = RecordKey("tenant-a", "POST /payouts", "k")
RECORD = ("--tenant", "t", "--operation", "POST /payouts")
MAX_NOTE_CHARS = 1000


async def _unknown(store: MemoryStore) -> None:
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await store.settle(KEY, claim.generation, State.PENDING, Settlement(State.UNKNOWN))


async def test_the_bound_is_a_thousand_characters() -> None:
    assert getattr(ops, "MAX_NOTE_CHARS", None) == MAX_NOTE_CHARS


@pytest.mark.parametrize("size", [MAX_NOTE_CHARS + 1, 2 * 1024 * 1024])
async def test_resolve_refuses_a_note_over_the_bound(size: int) -> None:
    store = MemoryStore()
    await _unknown(store)
    with pytest.raises(ValueError, match="at most 1000 characters"):
        await resolve(store, KEY, Resolution.RETRY, note="n" * size)
    summary = await store.describe(KEY)
    assert summary is not None
    assert (summary.state, summary.note) == (State.UNKNOWN, None)


async def test_reopen_refuses_a_note_over_the_bound() -> None:
    store = MemoryStore()
    await _unknown(store)
    done = StoredResponse(201, [(b"content-type", b"application/json")], b"{}")
    await resolve(store, KEY, Resolution.SUCCEEDED, note="bank shows it", response=done)
    with pytest.raises(ValueError, match="at most 1000 characters"):
        await reopen(store, KEY, note="n" * (MAX_NOTE_CHARS + 1))
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.state is State.SUCCEEDED


async def test_a_note_at_the_bound_is_kept_whole_whatever_its_whitespace() -> None:
    store = MemoryStore()
    await _unknown(store)
    words = "n " * (MAX_NOTE_CHARS // 2)  # 1,000 characters as kept (the last space dropped)
    note = words.replace(" ", " \t\n  ")  # longer as given: its runs count as one space
    await resolve(store, KEY, Resolution.RETRY, note=note)
    summary = await store.describe(KEY)
    assert summary is not None
    assert summary.note is not None
    assert summary.note.endswith(f"resolve unknown -> pending: {words.strip()}")


@pytest.mark.parametrize("command", [("resolve", "--to", "retry"), ("reopen",)])
async def test_the_cli_refuses_a_note_over_the_bound(
    db_dsn: str, pool: Any, command: tuple[str, ...]
) -> None:
    state = "unknown" if command[0] == "resolve" else "succeeded"
    final = {"expires_at": datetime.now(UTC) + timedelta(days=1)}
    await insert(pool, "long-note", state, **final)
    note = "n" * (MAX_NOTE_CHARS + 1)
    result = cli(*command, *RECORD, "--key", "long-note", "--note", note, dsn=db_dsn)
    assert result.returncode == 2, result.stdout  # a usage error (it was 0: kept whole)
    assert "at most 1000 characters, not 1001" in result.stderr
    row = await pool.fetchrow("SELECT state, note FROM idem_requests WHERE idem_key = 'long-note'")
    assert (row["state"], row["note"]) == (state, None)
