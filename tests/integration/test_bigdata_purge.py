"""A purge run's batches cost the same from the first to the last while a snapshot is held open.

Each batch started at the first entry of `idem_requests_expires_idx`. The entries of the rows
the run had deleted stay in the index until a vacuum, and while a snapshot older than the
deletes is open (a long transaction, a backup, a standby's feedback) no scan may mark them
dead: every batch walked every row deleted before it, and visited its heap row. On 2 million
records batch 300 took 230 ms instead of 14, a run of 1,000 batches minutes instead of seconds.
Each batch now starts at the latest `expires_at` the batch before it deleted.

The plans are read through auto_explain, set up on the store's own connections each time one is
taken from the pool (the pool resets the settings, and drops the listener, when it is released):
the buffers the last batch's index scan touched, against the first's.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from idem_middleware.store.postgres import PostgresStore
from tests.conftest import migrated_database

BATCH, BATCHES = 50, 40

_EXPIRED = f"""
INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, retention,
                           expires_at, response_status)
SELECT 't', 'POST /x', i::text, '\\x00', 'succeeded', 'transactional', interval '1 second',
       now() - interval '1 day' + make_interval(secs => i), 201
FROM generate_series(1, {BATCH * BATCHES}) i;
ANALYZE idem_requests;
"""


@pytest.fixture(scope="module")
async def purge_dsn(admin_dsn: str) -> str:
    return await migrated_database(admin_dsn, "idem_bigdata_purge")


async def _explained(conn: Any, plans: list[dict[str, Any]]) -> None:
    def listen(_conn: Any, message: Any) -> None:
        text = message.message
        if "idem_requests_expires_idx" in text and "{" in text:
            plans.append(json.loads(text[text.index("{") :])["Plan"])

    conn.add_log_listener(listen)
    await conn.execute(
        "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
        " SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on;"
        " SET auto_explain.log_format = json; SET auto_explain.log_level = notice"
    )


def _index_buffers(plan: dict[str, Any]) -> int:
    if plan.get("Index Name") == "idem_requests_expires_idx":
        return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    return sum(_index_buffers(child) for child in plan.get("Plans", []))


@pytest.mark.filterwarnings("ignore:.*active log listener:asyncpg.InterfaceWarning")
async def test_a_purge_batch_does_not_walk_the_rows_its_run_deleted_before_it(
    purge_dsn: str,
) -> None:
    plans: list[dict[str, Any]] = []
    setup = await asyncpg.connect(purge_dsn)
    holder = await asyncpg.connect(purge_dsn)
    try:
        await setup.execute("DELETE FROM idem_requests; " + _EXPIRED)
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval("SELECT count(*) FROM idem_lock_secret")  # (its snapshot, held)
        pool = await asyncpg.create_pool(
            purge_dsn, min_size=1, max_size=3, setup=lambda c: _explained(c, plans)
        )
        try:
            async with PostgresStore(pool=pool) as store:
                deleted = await store.purge(batch_size=BATCH, max_batches=BATCHES + 1)
        finally:
            await pool.close()
    finally:
        await holder.close()
        await setup.close()
    assert deleted == BATCH * BATCHES
    buffers = [_index_buffers(plan) for plan in plans if plan["Node Type"] == "ModifyTable"]
    assert len(buffers) == BATCHES + 1, buffers  # (the last one deleting nothing)
    # Walking the rows deleted before it, each batch touched more: 3, 4, 5, ... 41 buffers.
    # (From the sixth run on asyncpg's prepared statement has its generic plan: the bound must
    # stay an index condition there too.)
    assert max(buffers[BATCHES // 2 : BATCHES]) <= 2 * max(buffers[:3]), buffers
