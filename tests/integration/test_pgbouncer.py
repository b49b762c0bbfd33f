"""The integration suites again, through PgBouncer in transaction pooling mode: the protocol,
failure, peer-regression, seed-model, store-contract, lease-mode, token and outbox suites.

The `pool` and `pg_store` fixtures are overridden here: the same tests run with every statement
going through PgBouncer 1.18 (no protocol-level prepared statements, so `statement_cache_size=0`),
and with LISTEN off, so lease-mode waiters are woken by polling alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import Mode, Policy, PostgresStore
from tests.pgbouncer import PgBouncer, binary

if binary() is None:  # pragma: no cover - .ci/run installs it
    pytest.skip(
        "pgbouncer is not installed (apt-get install -y pgbouncer)", allow_module_level=True
    )

# The suites re-run here, with this module's fixtures. (Names imported into a test module are
# collected again as its own tests.)
from tests.integration.test_http_failures import *  # noqa: F403
from tests.integration.test_http_protocol import *  # noqa: F403
from tests.integration.test_lease_mode import *  # noqa: F403
from tests.integration.test_outbox import *  # noqa: F403
from tests.integration.test_peer_regressions import *  # noqa: F403
from tests.integration.test_seed_model import *  # noqa: F403
from tests.integration.test_store_contract import *  # noqa: F403
from tests.integration.test_tokens import *  # noqa: F403

# These two assert that NOTIFY wakes a waiter: LISTEN cannot work through transaction pooling,
# which is why the store here runs with listen=False (polling covers it: see the last test).
for _notify_only in (
    "test_waiter_is_woken_by_notify_well_before_its_poll",
    "test_contract_watch_is_woken_by_settle_release_and_allow_retry",
):
    globals().pop(_notify_only)


@pytest.fixture(scope="module")
def bouncer(pg_dsn: str, db_dsn: str) -> Iterator[PgBouncer]:
    pgb = PgBouncer(pg_dsn).start()
    try:
        yield pgb
    finally:
        pgb.stop()


@pytest.fixture
async def pool(bouncer: PgBouncer) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await asyncpg.create_pool(
        bouncer.dsn("idem_test"), min_size=1, max_size=20, statement_cache_size=0
    )
    await pool.execute(
        "TRUNCATE idem_requests, idem_tokens, idem_outbox, idem_inbox, test_accounts, test_ledger"
    )
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def pg_store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool, listen=False) as store:
        yield store


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
