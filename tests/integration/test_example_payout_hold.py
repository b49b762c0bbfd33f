"""The example app's payout hold when the database fails it: a bounded wait, and a 503 problem.

The hold of a payout's amount is a transaction of its own before the bank is called. A row it
cannot take (another transaction holds the account) used to keep the request, and its key,
waiting for as long as that lasted, the lease renewed all along; a connection lost under it was
a plain-text 500. Both are now a `503` problem with `Retry-After`, and the retry, which asks the
bank first (nothing was sent to it), pays out once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest

from example_app.launcher import ServerProcess
from tests.conftest import _fresh_database
from tests.integration.test_example_payouts import (
    Ledger,
    account_id,
    app_env,
    balance,
    fund,
    key,
    payout,
    retry_until_settled,
    serving,
)

HOLD_SECONDS = 2.0


@pytest.fixture(scope="module")
async def app_db(admin_dsn: str) -> str:
    return await _fresh_database(admin_dsn, "idem_example_payout_hold")


@pytest.fixture(scope="module")
def server(app_db: str, bank: ServerProcess) -> Iterator[ServerProcess]:
    yield from serving(app_env(app_db, bank, EXAMPLE_HOLD_SECONDS=str(HOLD_SECONDS)))


@pytest.fixture
async def http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
async def ledger(app_db: str, bank: ServerProcess) -> AsyncIterator[Ledger]:
    async with httpx.AsyncClient(base_url=bank.url, timeout=30) as bank_http:
        yield Ledger(app_db, bank_http)


async def locked_account(app_db: str, account: str) -> asyncpg.Connection:
    """A connection in a transaction that holds `account`'s row (tenant-a's)."""
    conn = await asyncpg.connect(app_db)
    await conn.execute("BEGIN")
    await conn.execute(
        "SELECT FROM ex_accounts WHERE tenant = 'tenant-a' AND account_id = $1 FOR UPDATE",
        account,
    )
    return conn


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.headers["retry-after"] == "1"
    assert r.json()["detail"] == "the database is unavailable"


async def paid_once(http: httpx.AsyncClient, ledger: Ledger, acc: str, k: str) -> None:
    retried = await retry_until_settled(http, acc, 30, k)
    assert retried.status_code == 201, retried.text
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await balance(http, acc) == 70


async def test_a_hold_that_cannot_take_the_accounts_row_is_a_503_in_bounded_time(
    app_db: str, http: httpx.AsyncClient, ledger: Ledger
) -> None:
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    lock = await locked_account(app_db, acc)
    try:
        async with asyncio.timeout(HOLD_SECONDS + 8):  # (before: it waited for the lock)
            r = await payout(http, acc, 30, k)
    finally:
        await lock.close()  # (rolls back: the row is free)
    assert_unavailable(r)
    await paid_once(http, ledger, acc, k)


async def test_a_hold_whose_connection_is_lost_is_a_503_problem(
    app_db: str, http: httpx.AsyncClient, ledger: Ledger
) -> None:
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    lock = await locked_account(app_db, acc)
    admin = await asyncpg.connect(app_db)
    try:
        sent = asyncio.ensure_future(payout(http, acc, 30, k))
        terminated = False
        for _ in range(150):  # the hold waits on the row: its session is cut (before a 500)
            terminated = bool(
                await admin.fetchval(
                    "SELECT bool_or(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE ex_accounts%'"
                )
            )
            if terminated or sent.done():
                break
            await asyncio.sleep(0.01)
        async with asyncio.timeout(HOLD_SECONDS + 8):
            r = await sent
    finally:
        await lock.close()
        await admin.close()
    assert terminated, "the hold was never seen waiting on the row"
    assert_unavailable(r)
    await paid_once(http, ledger, acc, k)
