"""Past one database: `idem_requests` declared `PARTITION BY HASH (tenant)`.

A tenant-distributed PostgreSQL (Citus) keeps each tenant's rows on one node; the library fits
it if every statement a request sends finds its record in one partition. Here the store contract
(test_store_contract.py, test_seed_model.py and test_lease_contract.py, by their "partitioned"
database route) runs on a database whose `idem_requests` is hash-partitioned on `tenant`,
and every statement a transactional and a lease request send is checked to touch exactly one
partition, its tenant's. See docs/scaling.md.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import PostgresStore
from idem_middleware.store import RecordKey, State, StoredResponse
from idem_middleware.store.base import Settlement
from idem_middleware.store.migrations import migrate
from idem_middleware.store.postgres import _Q
from tests.apps import (
    PAYOUTS,
    Step,
    build_app,
    build_lease_app,
    client,
    key,
    reset_downstream,
)
from tests.conftest import _fresh_database
from tests.partitioning import (
    Sent,
    SentLog,
    Touched,
    describe,
    partition_by_tenant,
    partition_of,
    partitions,
)

# The contract suites (test_store_contract.py, test_seed_model.py, test_lease_contract.py) run
# on the partitioned table too, by their "partitioned" route (tests/conftest.py).


@pytest.fixture(scope="session")
async def db_dsn(partitioned_dsn: str) -> str:
    """conftest's `pool` and `pg_store` use the partitioned database in this module."""
    return partitioned_dsn


async def test_the_table_is_partitioned_by_tenant(pool: asyncpg.Pool[Any]) -> None:
    """The contract above really ran on a partitioned table."""
    strategy = await pool.fetchval(
        "SELECT pg_get_partkeydef('idem_requests'::regclass)",
    )
    assert strategy == "HASH (tenant)"
    assert len(await partitions(pool)) == 4


async def test_the_rebuild_carries_what_a_later_migration_adds(pg_dsn: str) -> None:
    """The conversion reads the table from the catalogue: a column, a check, an index and a
    trigger a later migration adds come along under their own names, with no edit here."""
    dsn = await _fresh_database(pg_dsn, "idem_test_partitioned_later")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        await conn.execute(
            """
            ALTER TABLE idem_requests ADD COLUMN later text DEFAULT 'x' NOT NULL
                CONSTRAINT idem_requests_later_check CHECK (later <> '');
            CREATE INDEX idem_requests_later_idx ON idem_requests (tenant, later)
                WHERE later <> 'x';
            ALTER TABLE idem_requests ADD CONSTRAINT idem_requests_later_key
                UNIQUE (tenant, later, idem_key);
            CREATE FUNCTION pg_temp.touch() RETURNS trigger LANGUAGE plpgsql
                AS $$ BEGIN RETURN NEW; END $$;
            CREATE TRIGGER idem_requests_later_trg BEFORE UPDATE ON idem_requests
                FOR EACH ROW EXECUTE FUNCTION pg_temp.touch();
            """
        )
        before = await describe(conn)
        await partition_by_tenant(conn)  # asserts the description is unchanged
        after = await describe(conn)
        strategy = await conn.fetchval("SELECT pg_get_partkeydef('idem_requests'::regclass)")
    finally:
        await conn.close()
    assert strategy == "HASH (tenant)"
    assert after == before
    assert "later" in [c[0] for c in after["columns"]]
    assert {"idem_requests_later_idx", "idem_requests_later_key", "idem_requests_pkey"} <= {
        i[0] for i in after["indexes"]
    }
    assert "idem_requests_later_trg" in [t[0] for t in after["triggers"]]


# -- every request-path statement touches one partition --------------------------------------------

#: Statements that are not on a request's path: they may read every partition.
NOT_REQUEST_PATH = {"purge_batch", "stats", "stats_unresolved", "list_records", "list_page"}
NOT_REQUEST_PATH.add("generations_ahead")  # (when a store opens)
NOT_REQUEST_PATH.add("key_arbiter")  # (when a store opens; planned, never run)
NOT_REQUEST_PATH.add("key_deferrable")  # (when a store opens; the catalog alone)

#: What a request sends that reads or writes idem_requests (named as in sql/queries.sql); each
#: must be seen below, so the check cannot pass by not sending it.
REQUEST_PATH = {
    "claim_plain",  # lease mode and the ordinary transactional path (a token's: `claim`)
    "claim_key",  # transactional fast path: BEGIN + claim in one message
    "insert_final_checked",  # ... and its record, written with the COMMIT
    "get",  # replays
    "complete",  # the ordinary transactional completion
    "reclaim_expired",
    "fence",
    "settle",
    "settle_checked",
    "heartbeat",
    "expire_lease",
    "takeover",
    "release",
    "allow_retry",
    "claim_key_count",  # the ordinary transactional path takes the key's lock too
}

_BY_TEXT = {" ".join(text.split()): name for name, text in _Q.items()}


def _name(body: str) -> str | None:
    return _BY_TEXT.get(" ".join(body.split()).rstrip(";"))


def _tenant(sent: Any) -> str:
    """$1 is the tenant in every keyed query: the first argument, or the first literal."""
    if sent.args:
        tenant: str = sent.args[0]
        return tenant
    # The fast path's first literal: dollar-quoted text, or hex the server decodes.
    first = re.search(r"\$v\$([^$]*)\$v\$|'([^']*)'", sent.text)
    assert first is not None, sent.text
    if first.group(1) is not None:
        return first.group(1)
    try:
        return bytes.fromhex(first.group(2)).decode()
    except ValueError:
        return first.group(2)


@pytest.fixture
async def logged(db_dsn: str) -> AsyncIterator[tuple[SentLog, asyncpg.Pool[Any]]]:
    log = SentLog()
    setup = await asyncpg.connect(db_dsn)
    try:
        await setup.execute("TRUNCATE idem_requests, test_accounts, test_ledger")
        await reset_downstream(setup)
    finally:
        await setup.close()
    pool = await asyncpg.create_pool(db_dsn, init=log.attach, min_size=1, max_size=4)
    try:
        yield log, pool
    finally:
        await pool.close()


async def _post(c: httpx.AsyncClient, idem_key: str, status: int = 201) -> httpx.Response:
    response = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key(idem_key))
    assert response.status_code == status, response.text
    return response


def _tenants(other: str) -> Any:
    """demo-a is tenant-a, demo-b is `other` (a tenant whose rows live in another partition)."""

    def resolve(scope: Any) -> str | None:
        user = scope.get("user")
        if user is None or not user.is_authenticated:
            return None
        return other if user.display_name == "tenant-b" else str(user.display_name)

    return resolve


async def _transactional_requests(store: PostgresStore, bank: Any, other: str) -> None:
    """Fresh keys (both tenants), replays, an expired key claimed again, the status probe."""
    app = build_app(store, tenant_resolver=_tenants(other))
    async with client(app) as a, client(app, "demo-b") as b:
        for n in range(3):
            await _post(a, f"t{n}")
            await _post(b, f"t{n}")
            replay = await _post(a, f"t{n}")
            assert replay.headers.get("idempotent-replayed") == "true"
        await bank.execute("UPDATE idem_requests SET expires_at = now() WHERE idem_key = 't0'")
        await _post(a, "t0")
        for probed in ("t1", "absent"):
            status = await a.get(
                "/idempotency/status",
                params={"operation": "POST /accounts/{account_id}/credits", "key": probed},
            )
            assert status.status_code in (200, 404), status.text


async def _lease_requests(store: PostgresStore, bank: Any, other: str) -> None:
    """A lease request with a fenced write, its replay, and a held response settled early."""
    app = build_lease_app(store, bank, tenant_resolver=_tenants(other))
    app.state.probe.steps = [Step(fence="before"), Step(), Step(stream=True)]
    async with client(app) as c:
        for idem_key in ("l1", "l1", "l2", "l3"):
            body = {"account": "acc-1", "amount": 7}
            response = await c.post(PAYOUTS, json=body, headers=key(idem_key))
            assert response.status_code == 201, response.text


async def _lease_operations(store: PostgresStore, bank: Any, other: str) -> None:
    """Heartbeat, expiry, takeover, release, allow_retry and a fenced settlement, on the store."""
    fp, done = b"\x01" * 32, Settlement(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
    k = RecordKey(other, "POST /payouts", "ops")
    claimed = await store.claim_lease(k, fp, retention_seconds=60, lease_seconds=30)
    assert await store.heartbeat(k, claimed.generation, 30)
    await bank.execute("UPDATE idem_requests SET lease_expires_at = now() WHERE idem_key = 'ops'")
    assert await store.expire_lease(k, claimed.generation)
    assert await store.allow_retry(k, claimed.generation, "did not happen")
    record = await store.get(k)
    assert record is not None
    new = await store.takeover(k, record.generation, State.PENDING, 30)
    assert new is not None
    async with store.fenced(k, new) as fenced:
        assert await fenced.settle(done)
    k2 = RecordKey("tenant-a", "POST /payouts", "ops")
    again = await store.claim_lease(k2, fp, retention_seconds=60, lease_seconds=30)
    assert await store.release(k2, again.generation)
    again = await store.claim_lease(k2, fp, retention_seconds=60, lease_seconds=30)
    assert await store.settle(k2, again.generation, State.PENDING, done)
    await store.list_records(states=[State.PENDING, State.UNKNOWN])
    await store.list_page(
        State.UNKNOWN, tenant=None, operation=None, stale_only=False, size=9, until=None, after=None
    )
    await store.stats()
    await store.stats(unresolved_only=True)
    await store.purge()


async def test_every_request_path_statement_touches_one_partition(
    logged: tuple[SentLog, asyncpg.Pool[Any]], db_dsn: str
) -> None:
    log, pool = logged
    bank = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)  # not logged
    try:
        home = {"tenant-a": await partition_of(bank, "tenant-a")}
        for n in range(100):  # the second tenant lives apart from the first
            other = f"tenant-{n}"
            home[other] = await partition_of(bank, other)
            if home[other] != home["tenant-a"]:
                break
        async with PostgresStore(pool=pool) as store:
            await _transactional_requests(store, bank, other)
            await _lease_requests(store, bank, other)
            await _lease_operations(store, bank, other)
        async with PostgresStore(pool=pool, fast_path=False) as store:
            await bank.execute("TRUNCATE idem_requests")
            await _transactional_requests(store, bank, other)
    finally:
        await bank.close()

    conn = await asyncpg.connect(db_dsn, statement_cache_size=0)
    try:
        names = await partitions(conn)
        touched = Touched(conn, names)

        # The check is not vacuous: a statement without the tenant reads every partition, and
        # the counters see it inside a function too.
        unkeyed = Sent("SELECT 1 FROM idem_requests WHERE idem_key = $1", ("t1",))
        plans = await touched.in_plans(unkeyed, [])
        assert plans["force_custom_plan"] == plans["force_generic_plan"] == set(names)
        assert await touched.by_counters(unkeyed, []) == set(names)
        await conn.execute(
            "CREATE FUNCTION pg_temp.unkeyed(p_key text) RETURNS SETOF integer LANGUAGE plpgsql"
            " AS $$ BEGIN RETURN QUERY SELECT 1 FROM idem_requests WHERE idem_key = p_key; END $$"
        )
        assert await touched.by_counters(Sent("SELECT * FROM pg_temp.unkeyed('t1')"), []) == set(
            names
        )

        seen: set[str] = set()
        failures = []
        for sent, prepares in log.statements():
            if "idem_requests" not in sent.body and "FROM idem_claim_key(" not in sent.body:
                continue  # business tables, the sequence, the schema check, asyncpg's own
            name = _name(sent.body) or sent.body[:60]
            if name in NOT_REQUEST_PATH:
                seen.add(name)
                continue
            plans = await touched.in_plans(sent, prepares)
            counted = await touched.by_counters(sent, prepares)
            expected = {home[_tenant(sent)]}
            for how, found in (*plans.items(), ("counters", counted)):
                # A plan names no partition for an INSERT (its row is routed as it runs): the
                # counters then say where it went.
                if found and found != expected:
                    failures.append(f"{name} ({how}): {sorted(found)}, not {sorted(expected)}")
            if set().union(*plans.values(), counted) != expected:
                failures.append(f"{name}: touched {sorted(set().union(*plans.values(), counted))}")
            seen.add(name)
    finally:
        await conn.close()
    assert not failures, "\n".join(failures)
    assert seen >= REQUEST_PATH | NOT_REQUEST_PATH, sorted(REQUEST_PATH - seen)
