"""Each purge statement deletes at most its batch, whatever plan PostgreSQL picks.

A batch was `DELETE ... USING (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`. With the statistics
of a table once emptied (analyzed with no rows, the usual state of a table just purged), the
planner joined the rows to that subquery in a nested loop and ran it again for each row; each
run skipped the rows the statement had deleted already and locked the next ones, so a batch of 2
deleted all 5 rows it could reach: `--batch-size` and `--max-batches` bounded nothing, and one
purge of a large backlog was a single statement holding every row it deleted. The batches are
now chosen once, in a materialized CTE."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import MemoryStore
from idem_middleware.sql import queries
from idem_middleware.store.base import Store
from tests.conftest import migrated_database
from tests.integration.test_cli import cli

#: Five rows, inserted oldest first (each statement takes the oldest first), by table.
_ROWS = {
    "idem_requests": (
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
        " retention, expires_at, response_status) SELECT 't', 'POST /x', i::text, '\\x00',"
        " 'succeeded', 'transactional', interval '1 second',"
        " now() - make_interval(hours => i), 201 FROM generate_series(5, 1, -1) i"
    ),
    "idem_tokens": (
        "INSERT INTO idem_tokens (tenant, token_hash, operation, expires_at)"
        " SELECT 't', convert_to(i::text, 'UTF8'), 'POST /x', now() - make_interval(hours => i)"
        " FROM generate_series(5, 1, -1) i"
    ),
    "idem_outbox": (
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at) SELECT i::text, 't', '{}',"
        " now() - make_interval(hours => i) FROM generate_series(5, 1, -1) i"
    ),
    "idem_inbox": (
        "INSERT INTO idem_inbox (consumer, event_id, received_at) SELECT 'c', i::text,"
        " now() - make_interval(hours => i) FROM generate_series(5, 1, -1) i"
    ),
}

#: (statement, its table, its arguments: a batch of 2)
_BATCHES = [
    ("purge_batch", "idem_requests", (2, None)),
    ("purge_tokens", "idem_tokens", (2, None)),
    ("outbox_purge", "idem_outbox", (2, 60.0, None)),
    ("inbox_purge", "idem_inbox", (2, 60.0, None)),
]


@pytest.fixture(scope="module")
async def batches_dsn(admin_dsn: str) -> str:
    """A database of the module's own: its tables' statistics are made to mislead the planner."""
    return await migrated_database(admin_dsn, "idem_purge_batches")


@pytest.fixture
async def conn(batches_dsn: str) -> AsyncIterator[Any]:
    conn = await asyncpg.connect(batches_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def _emptied_then_filled(conn: Any, table: str) -> None:
    """The table's statistics say it is empty (analyzed after a purge); then five rows."""
    await conn.execute(f"DELETE FROM {table}")
    await conn.execute(_ROWS[table])
    await conn.execute(f"DELETE FROM {table}")
    await conn.execute(f"ANALYZE {table}")
    await conn.execute(_ROWS[table])


@pytest.mark.parametrize(("name", "table", "args"), _BATCHES, ids=[b[0] for b in _BATCHES])
async def test_a_purge_batch_deletes_at_most_its_size(
    conn: Any, name: str, table: str, args: tuple[Any, ...]
) -> None:
    await _emptied_then_filled(conn, table)
    assert await conn.execute(queries()[name], *args) == "DELETE 2"
    assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 3


_EXPIRED_TOKENS = (
    "INSERT INTO idem_tokens (tenant, token_hash, operation, expires_at) SELECT 't',"
    " sha256(i::text::bytea), 'POST /x', now() - interval '1 day' FROM generate_series(1, 250) i"
)


async def test_purge_says_when_the_tokens_stopped_at_max_batches(
    conn: Any, batches_dsn: str
) -> None:
    """Every batch of tokens full, none of records: `purge` said `"stopped_at_limit": false`
    and nothing on stderr, and 50 expired tokens were left unsaid."""
    await conn.execute("DELETE FROM idem_requests; DELETE FROM idem_tokens")
    await conn.execute(_EXPIRED_TOKENS)
    args = ("purge", "--batch-size", "100", "--max-batches", "2", "--json")
    done = cli(*args, dsn=batches_dsn)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"purged": 0, "stopped_at_limit": True}
    assert "purge stopped at --max-batches (2 batches of 100): expired tokens may" in done.stderr
    assert await conn.fetchval("SELECT count(*) FROM idem_tokens") == 50
    again = cli(*args, dsn=batches_dsn)
    assert json.loads(again.stdout) == {"purged": 0, "stopped_at_limit": False}
    assert again.stderr == ""


async def test_the_twin_names_its_tokens_stopped_at_max_batches() -> None:
    store = MemoryStore()
    for i in range(5):
        store.add_token("t", b"%d" % i, "POST /x", ttl_seconds=-1)
    limited: list[str] = []
    assert await store.purge(batch_size=2, max_batches=2, on_limit=limited.append) == 0
    assert limited == ["tokens"]
    limited.clear()
    assert await store.purge(batch_size=2, max_batches=2, on_limit=limited.append) == 0
    assert limited == []  # the one left: a batch not full


@pytest.mark.parametrize("on_limit", [42, "print"], ids=["a number", "a str"])
async def test_purge_refuses_an_on_limit_it_cannot_call_before_any_row_is_deleted(
    store: Store, on_limit: Any
) -> None:
    """Found by probing: an `on_limit` that was no function failed only after the batches had
    committed (on PostgreSQL the waiters' purge was then skipped, and the count lost); an async
    one was called and its coroutine never run, the report lost."""
    with pytest.raises(ValueError, match="purge: on_limit is called"):
        await store.purge(on_limit=on_limit)

    async def reported(what: str) -> None:  # pragma: no cover - never run
        raise AssertionError(what)

    with pytest.raises(ValueError, match="an async one"):
        await store.purge(on_limit=reported)
