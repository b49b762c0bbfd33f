"""The purges' batches (of records, tokens, outbox events, inbox rows) cost the same from the
first to the last while a snapshot is held open.

Each of their batches started at the first entry of its index (expiry, sent, received). The
entries of the rows the run had deleted stay in the index until a vacuum, and while a snapshot
older than the deletes is open (a long transaction, a backup, a standby's feedback) no scan may
mark them dead: every batch walked every row deleted before it, and visited its heap row (on 2
million records batch 300 of a run took 230 ms instead of 14). Each batch now starts at the
latest value the batch before it deleted.

The plans are read through auto_explain on the store's own connections: the buffers each batch's
index scan touched, the later batches' against the first's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from idem_middleware.store.postgres import PostgresStore
from tests.conftest import migrated_database

BATCH, BATCHES = 50, 40
_ROWS = f"generate_series(1, {BATCH * BATCHES}) i"
_AGO = "now() - interval '1 day' + make_interval(secs => i)"

#: (the index each batch walks, its rows: past their expiry or age, oldest first, the purge)
_PURGES: dict[str, tuple[str, str, Callable[[PostgresStore], Awaitable[int]]]] = {
    "records": (
        "idem_requests_expires_idx",
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
        " retention, expires_at, response_status) SELECT 't', 'POST /x', i::text, '\\x00',"
        f" 'succeeded', 'transactional', interval '1 second', {_AGO}, 201 FROM {_ROWS}",
        lambda store: store.purge(batch_size=BATCH, max_batches=BATCHES + 1),
    ),
    "tokens": (
        "idem_tokens_expires_idx",
        "INSERT INTO idem_tokens (tenant, token_hash, operation, expires_at)"
        f" SELECT 't', sha256(i::text::bytea), 'POST /x', {_AGO} FROM {_ROWS}",
        lambda store: store.purge(batch_size=BATCH, max_batches=BATCHES + 1),
    ),
    "outbox": (
        "idem_outbox_sent_idx",
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
        f" SELECT i::text, 't', '{{}}', {_AGO} FROM {_ROWS}",
        lambda store: store.outbox_purge(BATCH, 60.0, BATCHES + 1),
    ),
    "inbox": (
        "idem_inbox_received_idx",
        "INSERT INTO idem_inbox (consumer, event_id, received_at)"
        f" SELECT 'c', i::text, {_AGO} FROM {_ROWS}",
        lambda store: store.inbox_purge(BATCH, 60.0, BATCHES + 1),
    ),
}


@pytest.fixture(scope="module")
async def keyset_dsn(admin_dsn: str) -> str:
    return await migrated_database(admin_dsn, "idem_purges_keyset")


async def _explained(conn: Any, index: str, plans: list[dict[str, Any]]) -> None:
    def listen(_conn: Any, message: Any) -> None:
        text = message.message
        if index in text and "{" in text:
            plans.append(json.loads(text[text.index("{") :])["Plan"])

    conn.add_log_listener(listen)
    await conn.execute(
        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
        " SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on;"
        " SET auto_explain.log_format = json; SET auto_explain.log_level = notice"
    )


def _index_buffers(plan: dict[str, Any], index: str) -> int:
    if plan.get("Index Name") == index:
        return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    return sum(_index_buffers(child, index) for child in plan.get("Plans", []))


@pytest.mark.filterwarnings("ignore:.*active log listener:asyncpg.InterfaceWarning")
@pytest.mark.parametrize("what", list(_PURGES))
async def test_a_purges_batch_does_not_walk_the_rows_its_run_deleted_before_it(
    keyset_dsn: str, what: str
) -> None:
    index, fill, purge = _PURGES[what]
    plans: list[dict[str, Any]] = []
    setup = await asyncpg.connect(keyset_dsn)
    holder = await asyncpg.connect(keyset_dsn)
    try:
        await setup.execute(
            "DELETE FROM idem_requests; DELETE FROM idem_tokens; DELETE FROM idem_outbox;"
            f" DELETE FROM idem_inbox; {fill};"
            " ANALYZE idem_requests, idem_tokens, idem_outbox, idem_inbox"
        )
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval("SELECT count(*) FROM idem_lock_secret")  # (its snapshot, held)
        pool = await asyncpg.create_pool(
            keyset_dsn, min_size=1, max_size=3, setup=lambda c: _explained(c, index, plans)
        )
        try:
            async with PostgresStore(pool=pool) as store:
                deleted = await purge(store)
        finally:
            await pool.close()
        left = await setup.fetchval(f"SELECT count(*) FROM {fill.split()[2]}")
    finally:
        await holder.close()
        await setup.close()
    assert (deleted, left) == (0 if what == "tokens" else BATCH * BATCHES, 0)  # (`purge`: records)
    buffers = [_index_buffers(plan, index) for plan in plans if plan["Node Type"] == "ModifyTable"]
    assert len(buffers) == BATCHES + 1, buffers  # (the last one deleting nothing)
    # Walking the rows deleted before it, each batch touched more than the one before. (From
    # the sixth run on, asyncpg's prepared statement may have its generic plan: the bound must
    # stay an index condition there too.)
    assert max(buffers[BATCHES // 2 : BATCHES]) <= 2 * max(buffers[:3]), buffers
