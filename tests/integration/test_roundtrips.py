"""Round trips per request path, measured from asyncpg's query log (not estimated).

The README's round-trip table is printed by `python -m bench.roundtrips`, which runs the same
measurement; these tests pin the numbers so a change that adds a round trip fails here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import Policy, PostgresStore
from tests.apps import build_app, client


class QueryLog:
    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, record: Any) -> None:
        self.queries.append(" ".join(record.query.split()))

    def kinds(self) -> list[str]:
        """Each statement reduced to a short name: BEGIN, COMMIT, claim, handler, ..."""
        out = []
        for q in self.queries:
            if q in ("BEGIN;", "BEGIN ISOLATION LEVEL READ COMMITTED;") or q.startswith("BEGIN"):
                out.append("BEGIN")
            elif q.startswith(("COMMIT", "ROLLBACK")):
                out.append(q.rstrip(";").split()[0])
            elif q.startswith("WITH ins AS"):
                out.append("claim")
            elif q.startswith("UPDATE idem_requests SET state = $5"):
                out.append("complete")
            elif q.startswith("SELECT pg_advisory_unlock_all()"):
                out.append("reset")  # asyncpg's pool resets a connection on release
            elif "test_ledger" in q or "test_accounts" in q:
                out.append("handler")
            else:
                out.append(q[:40])
        return out


@pytest.fixture
async def logged(db_dsn: str) -> Any:
    log = QueryLog()

    async def init(conn: asyncpg.Connection[Any]) -> None:
        conn.add_query_logger(log)

    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=4, init=init)
    await pool.execute("TRUNCATE idem_requests, test_accounts, test_ledger")
    log.queries.clear()
    try:
        yield pool, log
    finally:
        await pool.close()


async def _post(c: Any, key: str, amount: int = 5) -> Any:
    return await c.post(
        "/accounts/a1/credits", json={"amount": amount}, headers={"idempotency-key": key}
    )


async def test_fresh_claim_adds_two_statements_and_no_commit(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        r = await _post(c, "fresh")
    assert r.status_code == 201
    # The bare handler's transaction is BEGIN, its 2 statements, COMMIT; we add claim + complete.
    assert log.kinds() == [
        "BEGIN",
        "claim",
        "handler",
        "handler",
        "complete",
        "COMMIT",
        "reset",
    ]


async def test_replay_is_one_statement_in_a_short_transaction(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        await _post(c, "replayed")
        log.queries.clear()
        r = await _post(c, "replayed")
    assert r.headers["idempotent-replayed"] == "true"
    assert log.kinds() == ["BEGIN", "claim", "ROLLBACK", "reset"]


async def test_mismatch_costs_the_same_as_a_replay(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        await _post(c, "reused")
        log.queries.clear()
        r = await _post(c, "reused", amount=6)
    assert r.status_code == 422
    assert log.kinds() == ["BEGIN", "claim", "ROLLBACK", "reset"]


async def test_in_flight_duplicate_waits_then_reads_the_committed_record(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool), default_policy=Policy(wait_seconds=5))
    probe = app.state.probe
    probe.gate = asyncio.Event()
    async with client(app) as c:
        first = asyncio.ensure_future(_post(c, "inflight"))
        await asyncio.wait_for(probe.entered.wait(), 5)
        log.queries.clear()
        second = asyncio.ensure_future(_post(c, "inflight"))
        await asyncio.sleep(0.2)  # the duplicate is now blocked on the claim row
        probe.gate.set()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (r1.status_code, r2.status_code) == (201, 201)
    assert r2.headers["idempotent-replayed"] == "true"
    # The waiter's claim returns nothing (the row committed after its snapshot), so it reads it.
    duplicate = [k for k in log.kinds() if k not in ("handler", "complete", "COMMIT", "reset")]
    assert duplicate.count("claim") == 1
    assert any(q.startswith("SELECT true AS found") for q in log.queries)
