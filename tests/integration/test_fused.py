"""The transactional fast path: BEGIN + claim and completion + COMMIT as single simple-query
messages with the values written as literals (store/postgres/fused.py).

What must hold: hostile values are stored exactly (quoting is right, nothing is injected);
values that cannot be literals take the ordinary path; a handler's `conn.transaction()` still
nests as a savepoint (asyncpg is told about our BEGIN); large responses are completed the
ordinary way; and the installed asyncpg still has what the fast path relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.store.postgres import (
    _NAMES,
    FUSE_MAX_BODY,
    _fusable,
    _inline,
    _literal,
    _NotFusable,
)
from tests.apps import (
    BearerBackend,
    QueryLog,
    assert_problem,
    build_app,
    client,
    count,
    key,
    logged_pool,
    one_route_app,
    records,
)


class Log(QueryLog):
    def fused(self) -> list[str]:
        """The fast claims: a simple-query message with the claim, prepared or inlined (with its
        BEGIN, or after it when the claim drew a batch of generations)."""
        return [
            q
            for q in self.queries
            if "EXECUTE idem_claim_key" in q or "SELECT * FROM idem_claim_key" in q
        ]


@pytest.fixture
async def logged(db_dsn: str) -> Any:
    log = Log()
    async with logged_pool(db_dsn, log) as pool:
        yield pool, log


def test_literals_quote_and_refuse() -> None:
    # Text dollar-quoted, or hex when it holds a `$`; bytes as hex (test_sql_safety.py: why).
    assert _literal("o'brien") == "$v$o'brien$v$::text"
    assert _literal("a$v$b") == "convert_from(decode('6124762462', 'hex'), 'UTF8')"
    assert _literal(b"\x00\xff") == "$v$\\x00ff$v$::bytea"
    assert _literal(None) == "NULL"
    assert _literal(7) == "7"
    assert _literal(1.5) == "1.5"
    with pytest.raises(_NotFusable):
        _literal("nul\x00byte")
    with pytest.raises(_NotFusable):
        _literal(float("nan"))

    class Tenant(str):
        pass

    with pytest.raises(_NotFusable):  # not exactly a str: the parameterised path takes it
        _literal(Tenant("t"))
    assert _inline("SELECT $1, $2, $10", list(range(1, 11))) == "SELECT 1, 2, 10"


HOSTILE_KEYS = [
    "o'brien",
    "it's a \\ key; $1 --",
    "x''y",
    "'); DROP TABLE idem_requests; --",
    "\\x41",
    # Against the dollar quotes: a `$` sends the value as hex instead.
    "$v$); DROP TABLE idem_requests; --",
    "ends in $v",
    "$$",
]


@pytest.mark.parametrize("idem_key", HOSTILE_KEYS)
async def test_hostile_keys_are_stored_exactly_through_the_fast_path(
    logged: Any, idem_key: str
) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    header = '"' + idem_key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    async with client(app) as c:
        first = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key(header))
        again = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key(header))
    assert first.status_code == 201
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert len(log.fused()) == 2  # both went the fast way
    [rec] = await records(pool)
    assert rec["idem_key"] == idem_key
    assert rec["state"] == "succeeded"
    assert await count(pool, "test_ledger") == 1


async def test_a_tenant_with_a_nul_takes_the_ordinary_path(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool), tenant_resolver=lambda scope: "ten\x00ant")
    async with client(app) as c:
        r = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key("nul"))
    # PostgreSQL text cannot hold a NUL, so the ordinary (parameterised) claim refuses it too;
    # what matters is that it was never spliced into a query string.
    assert r.status_code == 500
    assert log.fused() == []
    assert not any("ten\x00ant" in q for q in log.queries)
    assert await count(pool, "idem_requests") == 0


async def savepoints(request: Request) -> Response:
    """Writes a ledger row, then a second one in a savepoint that fails and is rolled back."""
    ctx = get_context(request)
    conn = ctx.connection
    await conn.execute(
        "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, 'kept', 1)", ctx.tenant
    )
    try:
        async with conn.transaction():  # nested: a savepoint inside the claim's transaction
            await conn.execute(
                "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, 'undone', 2)",
                ctx.tenant,
            )
            raise LookupError("undo the savepoint")
    except LookupError:
        pass
    return JSONResponse({"ok": True}, status_code=201)


async def test_a_handler_savepoint_nests_inside_the_fast_path_transaction(logged: Any) -> None:
    pool, log = logged
    app = one_route_app("/savepoints", savepoints, store=PostgresStore(pool=pool))
    async with client(app) as c:
        r = await c.post("/savepoints", json={}, headers=key("sp-1"))
    assert r.status_code == 201, r.text
    assert len(log.fused()) == 1
    assert any(q.startswith("SAVEPOINT") for q in log.queries)
    rows = await pool.fetch("SELECT account_id FROM test_ledger ORDER BY account_id")
    assert [row["account_id"] for row in rows] == ["kept"]
    [rec] = await records(pool)
    assert rec["state"] == "succeeded"
    # The connection went back to the pool clean: asyncpg knows the transaction is over.
    async with pool.acquire() as conn:
        assert not conn.is_in_transaction()
        async with conn.transaction():
            assert await conn.fetchval("SELECT 1") == 1


async def test_a_large_response_is_completed_the_ordinary_way(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool), default_policy=None)
    size = (FUSE_MAX_BODY // 1000 + 1) * 1000  # /big answers whole kilobytes
    async with client(app) as c:
        r = await c.post(f"/big?size={size}", json={}, headers=key("big"))
        again = await c.post(f"/big?size={size}", json={}, headers=key("big"))
    assert r.status_code == again.status_code
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == r.content
    assert len(r.content) == size
    # The record's one INSERT, parameterised, then its own COMMIT.
    inserts = [q for q in log.queries if q.startswith("INSERT INTO idem_requests") and "$11" in q]
    assert len(inserts) == 1
    assert "COMMIT;" in log.queries
    assert not any(q.startswith("EXECUTE idem_insert_final") for q in log.queries)


async def test_the_installed_asyncpg_supports_the_fast_path(pool: Any) -> None:
    # If a new asyncpg renames what store/postgres/compat.py uses, this fails before any user
    # notices that the store quietly went back to the slower path.
    async with pool.acquire() as conn:
        assert _fusable(conn)


async def test_prepared_statements_lost_by_the_pool_fall_back_to_inlined_text(
    db_dsn: str,
) -> None:
    """A pool whose reset drops our prepared statements (as DISCARD ALL, or PgBouncer moving the
    session, would): the next fast claim finds them missing, and the store inlines from then on."""
    log = Log()

    async def reset(conn: asyncpg.Connection[Any]) -> None:
        await conn.reset()
        for name in (_NAMES["claim_key"], _NAMES["insert_final_checked"]):
            with contextlib.suppress(asyncpg.exceptions.InvalidSQLStatementNameError):
                await conn.execute(f"DEALLOCATE {name}")

    async with logged_pool(db_dsn, log, max_size=1, reset=reset) as pool:
        app = build_app(PostgresStore(pool=pool))
        async with client(app) as c:
            answers = [
                await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key(f"k{i}"))
                for i in range(3)
            ]
        assert [r.status_code for r in answers] == [201, 201, 201]
        assert await count(pool, "test_ledger") == 3
        fast = log.fused()
        assert "EXECUTE idem_claim_key" in fast[0]  # prepared, then used
        assert fast[-1].startswith("BEGIN; SELECT * FROM idem_claim_key(")  # inlined after the miss


async def fenced_credit(request: Request) -> Response:
    ctx = get_context(request)
    conn = await ctx.fenced_connection()
    await conn.execute(
        "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, 'fenced', 1)", ctx.tenant
    )
    return JSONResponse({"ok": True}, status_code=201)


async def test_lease_fence_and_settlement_travel_with_begin_and_commit(logged: Any) -> None:
    pool, log = logged
    app = one_route_app(
        "/fenced",
        fenced_credit,
        store=PostgresStore(pool=pool, listen=False),
        default_policy=Policy(mode=Mode.LEASE),
    )
    async with client(app) as c:
        r = await c.post("/fenced", json={}, headers=key("lease-1"))
        again = await c.post("/fenced", json={}, headers=key("lease-1"))
    assert r.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    fence = [q for q in log.queries if "BEGIN; EXECUTE idem_fence" in q]
    settle = [q for q in log.queries if q.startswith("EXECUTE idem_settle_checked")]
    assert len(fence) == 1
    assert len(settle) == 1
    assert settle[0].endswith("; COMMIT")
    [rec] = await records(pool)
    assert rec["state"] == "succeeded"
    assert await count(pool, "test_ledger") == 1
    async with pool.acquire() as conn:  # asyncpg knows the fenced transaction is over
        assert not conn.is_in_transaction()


# -- the record written once, at commit (migration 0003) ------------------------------------------

CREDIT_OP = "POST /accounts/{account_id}/credits"


async def test_a_fresh_claim_writes_the_record_once_with_its_outcome(logged: Any) -> None:
    """The claim takes the key's advisory lock and writes nothing; the completion is the
    record's one INSERT: no pending row, no UPDATE, one row version."""
    pool, log = logged
    await pool.execute("TRUNCATE idem_requests")  # (the row versions below count from (0,1))
    log.queries.clear()
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        r = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key("once"))
        again = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key("once"))
    assert r.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    run = [part for q in log.queries for part in q.split("; ") if not part.startswith("PREPARE")]
    older = (
        "UPDATE idem_requests",
        "WITH completed",
        "EXECUTE idem_claim_fresh",
        "EXECUTE idem_complete",
    )
    assert not any(statement.startswith(older) for statement in run)
    (completion,) = [q for q in log.queries if "EXECUTE idem_insert_final" in q]
    assert completion.endswith("COMMIT")
    row = await pool.fetchrow(
        "SELECT ctid::text, state, mode, response_status,"
        " expires_at - created_at >= retention AS kept FROM idem_requests"
    )
    # The table was truncated: the first row version written is (0,1); an UPDATE would have
    # left the record at (0,2).
    assert dict(row) == {
        "ctid": "(0,1)",
        "state": "succeeded",
        "mode": "transactional",
        "response_status": 201,
        "kept": True,
    }


async def test_a_record_that_appears_while_the_handler_runs_wins(logged: Any) -> None:
    """A claim that takes no advisory lock (a token claim, the ordinary path, a lease claim of
    the same operation) commits a record for the key while our handler runs: our INSERT fails,
    the handler's writes roll back, and the attempt runs again and finds that record."""
    pool, _ = logged
    app = build_app(PostgresStore(pool=pool), default_policy=Policy(wait_seconds=5))
    probe = app.state.probe
    probe.gate = asyncio.Event()
    async with client(app) as c:
        first = asyncio.ensure_future(
            c.post("/accounts/a1/credits", json={"amount": 5}, headers=key("raced"))
        )
        await asyncio.wait_for(probe.entered.wait(), 5)
        await pool.execute(
            "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
            "retention, expires_at, response_status, response_headers, response_body) "
            "VALUES ('tenant-a', $1, 'raced', '\\x00'::bytea, 'succeeded', 'transactional', "
            "interval '1 day', now() + interval '1 day', 201, ''::bytea, '{}'::bytea)",
            CREDIT_OP,
        )
        probe.gate.set()
        r = await asyncio.wait_for(first, 10)
    assert_problem(r, 422, "key-reused")  # the other record's fingerprint is not ours
    assert probe.calls == 1
    assert await count(pool, "test_ledger") == 0


async def test_a_lease_fence_first_on_a_connection_leaves_the_claim_prepared(db_dsn: str) -> None:
    """The first fast message on a connection prepares every fast statement. When that message
    is a lease fence, the transactional claim prepared with it must be the one this schema uses:
    otherwise the next claim finds it missing and the store stops preparing for good."""
    log = Log()
    async with logged_pool(db_dsn, log, max_size=1) as pool:
        store = PostgresStore(pool=pool, listen=False)
        transactional = build_app(store)  # its credit route, with the probe it reports to
        app = Starlette(
            routes=[Route("/fenced", fenced_credit, methods=["POST"]), *transactional.routes],
            middleware=[
                Middleware(AuthenticationMiddleware, backend=BearerBackend()),
                Middleware(
                    IdempotencyMiddleware,
                    store=store,
                    policies={"POST /fenced": Policy(mode=Mode.LEASE)},
                ),
            ],
        )
        app.state.probe = transactional.state.probe
        app.state.pool = None
        async with client(app) as c:
            lease = await c.post("/fenced", json={}, headers=key("lease-first"))
            credit = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key("tx"))
        assert (lease.status_code, credit.status_code) == (201, 201)
        assert any(q.startswith("EXECUTE idem_claim_key") for q in log.fused())
        assert not any(q.startswith("BEGIN; SELECT * FROM idem_claim_key") for q in log.fused())
