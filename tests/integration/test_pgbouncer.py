"""PgBouncer in transaction pooling mode, checked on its own.

The suites that must hold through PgBouncer (the protocol, failure, peer-regression, token and
outbox suites, lease mode and the store contract) run through it by their "pgbouncer" database
route (`pytest.mark.db_routes`, tests/conftest.py): every statement goes through PgBouncer
(no protocol-level prepared statements, so `statement_cache_size=0`), with LISTEN off, so
lease-mode waiters are woken by polling alone. Tests that assert a NOTIFY wake-up are marked
`needs_listen` and run directly only.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from idem_middleware import Mode, Policy, PostgresStore
from tests.pgbouncer import PgBouncer, binary

pytestmark = [
    pytest.mark.skipif(
        binary() is None, reason="pgbouncer is not installed (apt-get install -y pgbouncer)"
    ),
    pytest.mark.parametrize("db_route", ["pgbouncer"], indirect=True),
]


async def test_statements_really_go_through_pgbouncer(
    pool: asyncpg.Pool[Any], bouncer: PgBouncer
) -> None:
    async with pool.acquire() as conn:
        # The client side of this connection is PgBouncer's listening port, not PostgreSQL's.
        peer_port = conn._transport.get_extra_info("peername")[1]  # type: ignore[attr-defined]
        assert await conn.fetchval("SELECT 1") == 1
    assert peer_port == bouncer.port
    assert "login attempt: db=idem_test" in bouncer.log()
    assert pool._connect_kwargs["statement_cache_size"] == 0  # type: ignore[attr-defined]


async def test_lease_waiter_completes_by_polling_behind_pgbouncer(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """With LISTEN unavailable (PgBouncer), a duplicate of a pending lease request is answered
    by polling: it gets the replay once the original completes."""
    import asyncio

    from tests.apps import build_app, client

    app = build_app(pg_store, default_policy=Policy(mode=Mode.LEASE, wait_seconds=5))
    probe = app.state.probe
    probe.gate = asyncio.Event()
    async with client(app) as c:
        first = asyncio.ensure_future(
            c.post("/accounts/pb/credits", json={"amount": 2}, headers={"idempotency-key": "p"})
        )
        await asyncio.wait_for(probe.entered.wait(), 5)
        second = asyncio.ensure_future(
            c.post("/accounts/pb/credits", json={"amount": 2}, headers={"idempotency-key": "p"})
        )
        await asyncio.sleep(0.3)
        assert not second.done()  # it is waiting
        probe.gate.set()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (r1.status_code, r2.status_code) == (201, 201)
    assert r2.headers["idempotent-replayed"] == "true"
    assert probe.calls == 1


async def test_the_fast_path_runs_behind_pgbouncer_and_resets_in_the_message_that_commits(
    db_target: tuple[str, dict[str, Any]], pool: asyncpg.Pool[Any]
) -> None:
    """The fast path behind PgBouncer (which reports the client encoding as the client spelled
    it, `'utf-8'`), and the reset after the COMMIT in one message, through transaction pooling:
    answered, replayed, and the handler's writes committed once."""
    from tests.apps import QueryLog, build_app, client

    dsn, options = db_target
    log = QueryLog()
    store = PostgresStore(dsn=dsn, listen=False, connect_kwargs={**options, "init": log.attach})
    async with store, client(build_app(store)) as c:
        body, headers = {"amount": 3}, {"idempotency-key": "bounced"}
        first = await c.post("/accounts/pbr/credits", json=body, headers=headers)
        again = await c.post("/accounts/pbr/credits", json=body, headers=headers)
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    # (Prepared or inlined: PgBouncer moves the session between server connections.)
    assert any("; COMMIT; SELECT pg_advisory_unlock_all()" in q for q in log.queries)
    balance = await pool.fetchval("SELECT balance FROM test_accounts WHERE account_id = 'pbr'")
    assert balance == 3
