"""Mutants of the purges' keyset (each batch starts at the latest value the batch before it
deleted) killed, for the records', tokens', outbox's and inbox's purges:

- the bound is inclusive: rows that share one expiry (records completed in one transaction,
  tokens issued in one, events sent in one: one `now()`) across a batch's end are deleted by the
  next batch, not left for the next run;
- each batch takes the oldest rows: with the youngest stored first, a batch that took whatever
  it met first set the bound past the older ones, and they were left."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from idem_middleware.store.postgres import PostgresStore
from tests.conftest import migrated_database

ROWS, BATCH = 7, 2

#: (its table, rows `i` of `_ROWS` (their time given as {at}), the purge)
_PURGES: dict[str, tuple[str, str, Callable[[PostgresStore], Awaitable[int]]]] = {
    "records": (
        "idem_requests",
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
        " retention, expires_at, response_status) SELECT 't', 'POST /x', i::text, '\\x00',"
        " 'succeeded', 'transactional', interval '1 second', {at}, 201 FROM {rows}",
        lambda store: store.purge(batch_size=BATCH, max_batches=100),
    ),
    "tokens": (
        "idem_tokens",
        "INSERT INTO idem_tokens (tenant, token_hash, operation, expires_at)"
        " SELECT 't', sha256(i::text::bytea), 'POST /x', {at} FROM {rows}",
        lambda store: store.purge(batch_size=BATCH, max_batches=100),
    ),
    "outbox": (
        "idem_outbox",
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
        " SELECT i::text, 't', '{{}}', {at} FROM {rows}",
        lambda store: store.outbox_purge(BATCH, 60.0, 100),
    ),
    "inbox": (
        "idem_inbox",
        "INSERT INTO idem_inbox (consumer, event_id, received_at)"
        " SELECT 'c', i::text, {at} FROM {rows}",
        lambda store: store.inbox_purge(BATCH, 60.0, 100),
    ),
}

#: How the rows' times are laid out: all one time; the youngest stored first.
_LAYOUTS = {
    "one time": ("now() - interval '1 day'", f"generate_series(1, {ROWS}) i"),
    "youngest first": (
        "now() - interval '1 day' - make_interval(hours => i)",
        f"generate_series(1, {ROWS}) i",
    ),
}


@pytest.fixture(scope="module")
async def keyset_dsn(admin_dsn: str) -> str:
    return await migrated_database(admin_dsn, "idem_mutation16_purge_keyset")


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("what", list(_PURGES))
async def test_a_purge_run_deletes_every_row_past_its_time(
    keyset_dsn: str, what: str, layout: str
) -> None:
    table, fill, purge = _PURGES[what]
    at, rows = _LAYOUTS[layout]
    conn = await asyncpg.connect(keyset_dsn)
    try:
        await conn.execute(
            "DELETE FROM idem_requests; DELETE FROM idem_tokens; DELETE FROM idem_outbox;"
            f" DELETE FROM idem_inbox; {fill.format(at=at, rows=rows)}; ANALYZE {table}"
        )
        async with PostgresStore(dsn=keyset_dsn, min_size=1, max_size=2, listen=False) as store:
            deleted = await purge(store)
        left = await conn.fetchval(f"SELECT count(*) FROM {table}")
    finally:
        await conn.close()
    assert (deleted, left) == (0 if what == "tokens" else ROWS, 0)  # (`purge`: records)
