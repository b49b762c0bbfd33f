"""The plans of the store's statements on tables big enough that the planner's choice matters.

A database of its own holds 60,000 records across 300 tenants in every state (mostly finished,
some past their retention, some pending with lapsed and live leases, some unknown), issued
tokens, outbox events and consumers' inbox rows, analysed. Every statement on a request's path
must reach `idem_requests`, `idem_tokens`, `idem_outbox` and `idem_inbox` through an index, in the
custom plan its first runs get and in the generic plan asyncpg's prepared statements get after
five; the claim function's own statements too (seen through auto_explain). The batch statements
(purge, the outbox's and the inbox's purges, the reconciler's and operators' scans, the outbox's
poll) must read no table whole either.

docs/operating.md ("Maintenance at scale") has what these plans cost on 2 million records.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from idem_middleware.sql import queries
from idem_middleware.store.migrations import migrate
from tests.conftest import _fresh_database

_Q = queries()
BIG = ("idem_requests", "idem_tokens", "idem_outbox", "idem_inbox")
RECORDS = 60_000

_FILL = f"""
INSERT INTO idem_requests
    (tenant, operation, idem_key, fingerprint, state, mode, generation, epoch, created_at,
     updated_at, retention, lease_expires_at, expires_at, response_status, response_headers,
     response_body, note)
SELECT tenant, operation, key, sha256(convert_to(key, 'UTF8')), state, mode, i, i, at, at,
       interval '1 day',
       CASE WHEN state = 'pending' THEN
           CASE WHEN i / 100 % 2 = 0 THEN now() - interval '1 minute'
                ELSE now() + interval '1 hour' END
       END,
       CASE WHEN state IN ('succeeded', 'failed_final') THEN at + interval '1 day' END,
       CASE state WHEN 'succeeded' THEN 201 WHEN 'failed_final' THEN 422 END,
       CASE WHEN state IN ('succeeded', 'failed_final') THEN '\\x00'::bytea END,
       CASE WHEN state IN ('succeeded', 'failed_final') THEN convert_to(repeat('x', 200), 'UTF8')
       END,
       CASE WHEN state = 'unknown' THEN 'lease expired' END
FROM (
    SELECT i, 'tenant-' || (i % 300) AS tenant, 'POST /op-' || (i % 7) AS operation,
           md5(i::text) AS key,
           CASE WHEN i % 100 < 1 THEN 'pending' WHEN i % 100 < 2 THEN 'unknown'
                WHEN i % 100 < 6 THEN 'failed_final' ELSE 'succeeded' END AS state,
           CASE WHEN i % 100 < 2 OR i % 5 = 0 THEN 'lease' ELSE 'transactional' END AS mode,
           now() - interval '36 hours' * (1 - i::float8 / {RECORDS}) AS at
    FROM generate_series(1, {RECORDS}) AS i
) AS r;
SELECT setval('idem_generation_seq', {RECORDS} + 1);
INSERT INTO idem_tokens (tenant, token_hash, operation, intent_id, expires_at, consumed_at)
SELECT 'tenant-' || (i % 300), sha256(convert_to('token-' || i, 'UTF8')), 'POST /op-0',
       CASE WHEN i % 2 = 0 THEN 'intent-' || i END,
       now() + interval '1 hour' - interval '1 minute' * i,
       CASE WHEN i % 3 = 0 THEN now() END
FROM generate_series(1, 20000) AS i;
INSERT INTO idem_outbox (event_id, tenant, topic, payload, created_at, next_attempt_at, sent_at)
SELECT 'event-' || i, 'tenant-' || (i % 300), 'paid', '{{}}', now() - interval '1 minute' * i,
       now() - interval '1 minute' * i,
       CASE WHEN i > 50 THEN now() - interval '1 minute' * i END
FROM generate_series(1, 30000) AS i;
INSERT INTO idem_inbox (consumer, event_id, received_at)
SELECT 'consumer-' || (i % 3), 'event-' || i, now() - interval '1 minute' * i
FROM generate_series(1, 30000) AS i;
ANALYZE idem_requests, idem_tokens, idem_outbox, idem_inbox;
"""


@pytest.fixture(scope="module")
async def plans_dsn(pg_dsn: str) -> str:
    dsn = await _fresh_database(pg_dsn, "idem_test_plans")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute(_FILL)
    finally:
        await conn.close()
    return dsn


@pytest.fixture(scope="module")
async def plans_conn(plans_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn = await asyncpg.connect(plans_dsn, statement_cache_size=0)
    try:
        yield conn
    finally:
        await conn.close()


async def _one(conn: Any, where: str) -> tuple[Any, ...]:
    row = await conn.fetchrow(
        f"SELECT tenant, operation, idem_key, generation FROM idem_requests WHERE {where} LIMIT 1"
    )
    assert row is not None, where
    return tuple(row)


def _renewals(asked: list[tuple[Any, ...]]) -> tuple[list[Any], ...]:
    """`heartbeat_batch`'s arguments (its columns) for renewals of (tenant, operation, key,
    generation), each on a 30 s lease."""
    return tuple(list(column) for column in zip(*((*a, 30.0) for a in asked), strict=True))


async def _cases(conn: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Arguments for each named statement, picked from the filled tables."""
    *live, _ = await _one(conn, "state = 'succeeded' AND expires_at > now()")
    *expired, _ = await _one(conn, "state = 'succeeded' AND expires_at <= now()")
    *leased, g_leased = await _one(conn, "state = 'pending' AND lease_expires_at > now()")
    *lapsed, g_lapsed = await _one(conn, "state = 'pending' AND lease_expires_at <= now()")
    *unknown, g_unknown = await _one(conn, "state = 'unknown'")
    token = await conn.fetchrow("SELECT tenant, token_hash, operation FROM idem_tokens LIMIT 1")
    cursor = await conn.fetchrow(
        "SELECT now(), updated_at, tenant, operation, idem_key FROM idem_requests "
        "WHERE state = 'unknown' ORDER BY updated_at OFFSET 10 LIMIT 1"
    )
    fresh = (live[0], live[1], "a-fresh-key")
    fp, answer = b"\x01" * 32, (201, b"h", b"b", None)
    lease = ("lease", 86400.0, 30.0)
    return {
        "claim": [  # (the last: the key's claim lock, as a lease claim tries it)
            (*fresh, fp, *lease, None, 1),
            (*live, fp, *lease, None, 1),
            (token["tenant"], token["operation"], "tk", fp, *lease, token["token_hash"], None),
        ],
        "claim_plain": [
            (*fresh, fp, *lease, 1),
            (*live, fp, *lease, 1),
            (*fresh, fp, *lease, None),
        ],
        "claim_key": [(*fresh, 1)],
        "claim_key_count": [(*fresh, 1)],
        "insert_final": [(*fresh, fp, 10**9, 86400.0, "succeeded", *answer)],
        "insert_final_checked": [(*fresh, fp, 10**9, 86400.0, "succeeded", *answer)],
        "reclaim_expired": [(*expired, fp, *lease, None)],
        "reclaim_released": [(*leased, fp, g_leased, 86400.0)],
        "expire_lapsed": [(*lapsed, g_lapsed, "n")],
        "get": [live],
        "peek": [(*live, 42), (live[0], live[1], "a-free-key", 42)],
        "describe": [live],
        "complete": [(*leased, g_leased, "succeeded", *answer)],
        "complete_checked": [(*leased, g_leased, "succeeded", *answer)],
        "heartbeat": [(*leased, g_leased, 30.0)],
        "heartbeat_batch": [_renewals([(*leased, g_leased), (*lapsed, g_lapsed), (*unknown, 1)])],
        "expire_lease": [(*lapsed, g_lapsed, "n")],
        "takeover": [(*lapsed, g_lapsed, "pending", 30.0)],
        "fence": [(*leased, g_leased, "pending")],
        "fence_nowait": [(*unknown, g_unknown, "unknown")],
        "settle": [(*leased, g_leased, "pending", "succeeded", *answer, None, "n")],
        "settle_checked": [(*leased, g_leased, "pending", "succeeded", *answer, None, "n")],
        "release": [(*leased, g_leased, "n")],
        "allow_retry": [(*unknown, g_unknown, "note", "n")],
        "mark_asked": [(*unknown, g_unknown)],
        "amend": [(*unknown, g_unknown, "unknown", "succeeded", *answer, "line", "n")],
        "token_status": [(token["tenant"], token["token_hash"], token["operation"], fp)],
        "issue_token": [(live[0], b"\x02" * 32, "POST /op-0", None, "intent-2", 600.0)],
        "outbox_add": [("event-new", live[0], "paid", "{}")],
        "outbox_same": [("event-7", live[0], "paid", "{}")],
        "outbox_claim": [(30.0, 10)],
        "outbox_sent": [("event-7",)],
        "outbox_failed": [("event-7", "error", 1.0, 10, 1)],
        "outbox_requeue": [(["event-7"],)],
        "inbox_record": [("consumer", "event-7")],
        # Batches: one purge batch, the reconciler's and the operator's listings.
        "purge_batch": [(1000, None), (1000, datetime(2000, 1, 1, tzinfo=UTC))],  # (after a batch)
        "generations_ahead": [(1000,)],
        "outbox_purge": [(1000, 19 * 86400.0, None)],  # the older events: a run's backlog
        "inbox_purge": [(1000, 19 * 86400.0, None)],  # (the same: the older rows)
        "purge_tokens": [(1000, None)],
        "list_records": [
            (["pending", "unknown"], None, None, 100, False),
            (["unknown"], None, None, 100, False),
            (["pending"], None, None, 100, True),
            (["unknown"], live[0], None, 100, False),
        ],
        # `idem-middleware list`: the first page of a state, then one after a cursor.
        "list_page": [
            ("unknown", None, None, 5000, False, None, None, None, None, None),
            ("pending", None, None, 5000, True, None, None, None, None, None),
            ("unknown", live[0], None, 5000, False, None, None, None, None, None),
            ("unknown", None, None, 5000, False, *cursor),
        ],
    }


#: Statements a request sends: their generic plans (asyncpg's prepared statements switch to one
#: after five runs when it costs no more than the custom ones) must use indexes as well.
PER_REQUEST = {
    "claim", "claim_plain", "claim_key", "claim_key_count", "insert_final",
    "insert_final_checked", "reclaim_expired",
    "get", "peek", "reclaim_released", "expire_lapsed",
    "describe", "complete", "complete_checked", "heartbeat", "heartbeat_batch", "expire_lease",
    "takeover", "fence",
    "fence_nowait", "settle", "settle_checked", "release", "allow_retry", "amend", "token_status",
    "issue_token",
    "outbox_add", "outbox_same", "outbox_claim", "outbox_sent", "outbox_failed",
    "outbox_requeue", "inbox_record",
}  # fmt: skip
#: Batches: a parameter in a partial index's predicate or in a LIMIT makes their generic plans
#: read the table whole, so their cost keeps asyncpg's plan cache on custom plans (checked below).
PER_BATCH = {"purge_batch", "outbox_purge", "inbox_purge", "list_records", "list_page"}
PER_REQUEST.add("mark_asked")  # (`reconcile`'s, one per record asked: by the key, as those)
PER_BATCH.add("generations_ahead")  # (when a store opens, over a table of any size)
PER_BATCH.add("purge_tokens")  # (`purge`'s, after the records')
#: Off every path but an operator's or a metrics scrape: counted in docs/operating.md.
ELSEWHERE = {
    "stats", "stats_unresolved", "outbox_stats", "outbox_list", "purge_waiters",
    "watch_begin", "watch_end", "draw_generations", "lock_secret", "writable", "privileges",
    "write_deferred", "unclaim", "outbox_row_security",
}  # fmt: skip
ELSEWHERE.add("key_arbiter")  # (when a store opens: EXPLAIN, planned only)
ELSEWHERE.add("key_deferrable")  # (when a store opens: the catalog alone)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _whole_reads(plan: dict[str, Any]) -> list[str]:
    """The big tables a plan reads whole (a sequential scan)."""
    return [
        node["Relation Name"]
        for node in _nodes(plan)
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in BIG
    ]


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"'\\x{value.hex()}'::bytea"
    if isinstance(value, list):
        return "ARRAY[" + ", ".join(_literal(v) for v in value) + "]::text[]"
    if isinstance(value, bool | int | float):
        return str(value).lower() if isinstance(value, bool) else repr(value)
    return "'" + str(value).replace("'", "''") + "'"


async def _plan(conn: Any, name: str, args: tuple[Any, ...], generic: bool) -> dict[str, Any]:
    """EXPLAIN (no ANALYZE: nothing runs) of a prepared `name`, custom or generic."""
    types = [
        "text[]" if t.kind == "array" else t.name
        for t in (await conn.prepare(_Q[name])).get_parameters()
    ]
    await conn.execute(f"PREPARE plan_probe ({', '.join(types)}) AS {_Q[name]}")
    try:
        mode = "force_generic_plan" if generic else "force_custom_plan"
        await conn.execute(f"SET plan_cache_mode = {mode}")
        if name in PER_BATCH:
            # A batch deletes what it picked by joining back on the key: on these 60,000 rows
            # the planner rightly hashes the whole table for it, on 2 million it probes the key
            # (measured: 15 ms a batch, docs/operating.md). The plan a big table gets, then.
            await conn.execute("SET enable_hashjoin = off; SET enable_mergejoin = off")
        values = ", ".join(_literal(a) for a in args)
        text = await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE plan_probe({values})")
    finally:
        await conn.execute(
            "RESET plan_cache_mode; RESET enable_hashjoin; RESET enable_mergejoin;"
            " DEALLOCATE plan_probe"
        )
    plan: dict[str, Any] = json.loads(text)[0]["Plan"]
    return plan


def test_every_named_statement_is_classified() -> None:
    assert set(_Q) == PER_REQUEST | PER_BATCH | ELSEWHERE
    assert not PER_REQUEST & PER_BATCH
    assert not (PER_REQUEST | PER_BATCH) & ELSEWHERE


async def test_no_statement_on_a_request_or_batch_path_reads_a_big_table_whole(
    plans_conn: Any,
) -> None:
    found: dict[str, list[str]] = {}
    for name, runs in (await _cases(plans_conn)).items():
        for i, args in enumerate(runs):
            for generic in (False, True) if name in PER_REQUEST else (False,):
                reads = _whole_reads(await _plan(plans_conn, name, args, generic))
                if reads:
                    found[f"{name}[{i}]{' generic' if generic else ''}"] = reads
    assert found == {}


async def test_the_claim_functions_statements_use_the_primary_key(plans_conn: Any) -> None:
    """`idem_claim_key` is PL/pgSQL: its statements' plans are seen through auto_explain, for a
    free key (both reads) and a held one."""
    conn = plans_conn
    notices: list[str] = []

    def listen(_conn: Any, message: Any) -> None:
        notices.append(message.message)

    conn.add_log_listener(listen)
    *held, _ = await _one(conn, "state = 'succeeded' AND expires_at > now()")
    try:
        await conn.execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
            " SET auto_explain.log_nested_statements = on; SET auto_explain.log_format = json;"
            " SET auto_explain.log_level = notice"
        )
        for key in ((held[0], held[1], "a-free-key"), tuple(held)):
            async with conn.transaction():
                await conn.fetch("SELECT * FROM idem_claim_key($1, $2, $3, 42)", *key)
    finally:
        await conn.execute("RESET auto_explain.log_min_duration")
        conn.remove_log_listener(listen)
    inner = [
        json.loads(n[n.index("{") :])["Plan"]
        for n in notices
        if "FROM idem_requests" in n and "idem_claim_key(" not in n.split("Plan")[0]
    ]
    assert len(inner) == 3  # free: two reads; held: one
    for plan in inner:
        assert plan.get("Index Name") == "idem_requests_pkey", plan
    assert not any(_whole_reads(plan) for plan in inner)


async def test_the_unresolved_count_reads_only_the_unresolved_index(plans_conn: Any) -> None:
    """`stats(unresolved_only=True)`, what the Prometheus gauges are fed from by default: its
    predicate is the partial index's own, so it reads that index and the heap rows it points to
    (0.002 s on 1 million records, against 0.15 s for `stats`' parallel scan of the table)."""
    plan = json.loads(await plans_conn.fetchval(f"EXPLAIN (FORMAT JSON) {_Q['stats_unresolved']}"))
    nodes = list(_nodes(plan[0]["Plan"]))
    assert _whole_reads(plan[0]["Plan"]) == []
    indexes = {node["Index Name"] for node in nodes if "Index Name" in node}
    assert indexes == {"idem_requests_unresolved_idx"}, nodes
    whole = json.loads(await plans_conn.fetchval(f"EXPLAIN (FORMAT JSON) {_Q['stats']}"))
    assert _whole_reads(whole[0]["Plan"]) == ["idem_requests"]  # (why it is not the default)


#: The batches over `idem_requests`. (The outbox's purge may get its generic plan: on an outbox
#: as small as this one it costs no more; on 760,000 events its custom plan stayed.)
#: (`purge_batch` may get its generic plan: its bound, `coalesce($2, ...)`, is an index condition
#: there too, checked below.)
RECORD_BATCHES = ("list_records", "list_page")


async def test_record_batches_keep_their_custom_plans_through_asyncpgs_statement_cache(
    plans_conn: Any, plans_dsn: str
) -> None:
    """A generic plan of `list_records` or `list_page` reads `idem_requests` whole (`state =
    ANY($1)` cannot use the partial index of unresolved records): run through prepared
    statements as the store runs them, the plan cache must keep to custom plans."""
    cases = await _cases(plans_conn)
    cached = await asyncpg.connect(plans_dsn)  # asyncpg's statement cache, as the store's pool
    try:
        transaction = cached.transaction()
        await transaction.start()
        try:
            for _ in range(10):
                for name in RECORD_BATCHES:
                    for args in cases[name]:
                        await cached.fetch(_Q[name], *args)
            rows = await cached.fetch(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            )
        finally:
            await transaction.rollback()
    finally:
        await cached.close()
    plans = {r["statement"]: (r["generic_plans"], r["custom_plans"]) for r in rows}
    for name in RECORD_BATCHES:
        generic, custom = plans[_Q[name]]
        assert (generic, custom >= 10) == (0, True), name


_BOUND = datetime(2000, 1, 1, tzinfo=UTC)
#: (statement, its arguments after a batch, the index it walks, the column that index orders)
_PURGES = [
    ("purge_batch", (1000, _BOUND), "idem_requests_expires_idx", "expires_at"),
    ("purge_tokens", (1000, _BOUND), "idem_tokens_expires_idx", "expires_at"),
    ("outbox_purge", (1000, 60.0, _BOUND), "idem_outbox_sent_idx", "sent_at"),
    ("inbox_purge", (1000, 60.0, _BOUND), "idem_inbox_received_idx", "received_at"),
]


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize(("name", "args", "index", "column"), _PURGES, ids=[p[0] for p in _PURGES])
async def test_a_purge_batch_starts_where_the_batch_before_it_ended(
    plans_conn: Any, generic: bool, name: str, args: tuple[Any, ...], index: str, column: str
) -> None:
    """A purge's batch walks its index from the bound its run's previous batch ended at, not
    from the index's first entry (those of the rows deleted before it, left until a vacuum,
    each cost a heap visit: tests/integration/test_purges_keyset.py),
    in its custom plan and in the generic one asyncpg's prepared statement gets after five."""
    plan = await _plan(plans_conn, name, args, generic)
    assert _whole_reads(plan) == []
    walks = [n for n in _nodes(plan) if n.get("Index Name") == index]
    assert len(walks) == 1, plan
    condition = walks[0]["Index Cond"]
    assert f"{column} >=" in condition, condition
    assert f"{column} <=" in condition, condition


async def test_a_heartbeat_changes_no_indexed_column_so_its_update_is_hot(plans_conn: Any) -> None:
    """A heartbeat sets `lease_expires_at` alone: as long as no index names it (a key column, an
    included one, an expression or a predicate), PostgreSQL updates the row in place on its page
    (HOT) and writes no index entry (measured on 2 million records: 97% of heartbeats HOT, 0.02
    dead row versions each). An index on it (for the reconciler's scan of lapsed leases, say)
    would make every heartbeat write an entry in every index, and leave one for vacuum."""
    definitions = await plans_conn.fetch(
        "SELECT pg_get_indexdef(indexrelid) AS d FROM pg_index"
        " WHERE indrelid = 'idem_requests'::regclass"
    )
    assert len(definitions) >= 3
    assert [r["d"] for r in definitions if "lease_expires_at" in r["d"]] == []


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
async def test_a_batch_of_renewals_reaches_each_record_through_the_primary_key(
    plans_conn: Any, generic: bool
) -> None:
    """`heartbeat_batch`: every read of `idem_requests` (the locking probe, the update, the
    answer's probe) goes through the primary key, whatever the batch's size."""
    rows = await plans_conn.fetch(
        "SELECT tenant, operation, idem_key, generation FROM idem_requests"
        " WHERE state = 'pending' LIMIT 500"
    )
    args = _renewals([tuple(r) for r in rows])
    plan = await _plan(plans_conn, "heartbeat_batch", args, generic)
    reads = [
        n
        for n in _nodes(plan)
        if n.get("Relation Name") == "idem_requests" and n["Node Type"].endswith("Scan")
    ]
    assert len(reads) == 3, reads
    assert {n.get("Index Name") for n in reads} == {"idem_requests_pkey"}, reads
