"""The fault scenarios (tests/integration/test_faults.py) fail fast, and say why, when keys stall.

Seen once on a loaded machine: `test_postgres_immediate_restart_under_load[payouts]` ran into
pytest-timeout's 300 s with nothing to go on. The example app's second worker was still starting
when PostgreSQL restarted: its store could not open, and uvicorn stopped the whole app. Every
request was then refused, each client spent 80 attempts per key, and the final pass went through
every key again. The scenario now waits for every worker, stops the clients as soon as the app
exits, and gives the clients a deadline: past it the keys still retried are stuck keys, reported
with what they kept getting, their records and the database's busy sessions.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

import tests.integration.test_faults as faults
from example_app.database import prepare
from example_app.launcher import ServerProcess
from tests.conftest import _fresh_database

DEADLINE = 12.0


@pytest.fixture(scope="module")
async def hang_db(admin_dsn: str) -> str:
    dsn = await _fresh_database(admin_dsn, "idem_restarthang")
    await prepare(dsn)
    return dsn


@pytest.fixture
def app(hang_db: str, bank: ServerProcess) -> Iterator[ServerProcess]:
    # (A payout's hold waits this long for its account's row: past the deadline, so that the
    # locked rows below wedge every payout in flight, as a hang the app does not bound would.)
    env = {
        "DATABASE_URL": hang_db,
        "BANK_URL": bank.url,
        **faults.CHAOS_ENV,
        "EXAMPLE_HOLD_SECONDS": str(DEADLINE * 5),
    }
    proc = ServerProcess("example_app", env=env, ready_path=faults.READY)
    proc.start(timeout=90)
    try:
        yield proc
    finally:
        proc.cleanup()


async def test_keys_wedged_in_flight_are_reported_at_the_deadline(
    app: ServerProcess, bank: ServerProcess, hang_db: str, monkeypatch: Any
) -> None:
    """Every payout waits for its account's row lock (in its hold, its lease renewed for good; in
    its debit, inside its fenced transaction, its lease lapses, renewals renewing nothing, but the
    fence's row lock keeps every takeover out; either way each retry gets 409 in flight): the
    scenario ends at its deadline, naming the keys, what they kept getting, their records and the
    session waiting for the lock. (Before: 80 attempts of about 2.5 s for each key, then the final
    pass again: pytest-timeout, and no word on why.)"""
    monkeypatch.setattr(faults, "CLIENTS_DEADLINE", DEADLINE)
    locker: list[Any] = []

    async def wedge() -> None:
        conn = await asyncpg.connect(hang_db)
        locker.append(conn)
        # Every account's row: a payout's hold waits for it (reads do not).
        await conn.execute("BEGIN; SELECT 1 FROM ex_accounts FOR UPDATE")

    started = time.monotonic()
    try:
        result = await faults.under_load(
            app,
            bank,
            hang_db,
            "payouts",
            prefix="wedged",
            inject=wedge,
            times=1,
            rng=random.Random(7),
            concurrency=3,
            watch=app,
        )
    finally:
        for conn in locker:
            await conn.close()
    took = time.monotonic() - started
    assert took < DEADLINE + 20, took
    assert not result.clean
    text = result.summary()
    print(text)  # (what the scenario's failure says: `-s` shows it)
    assert result.findings[0].startswith(f"the clients' deadline ({DEADLINE:g} s) passed: "), text
    assert "keys were still being retried" in result.findings[0], text
    assert any("waiting for Lock/" in f and "ex_accounts" in f for f in result.findings), text
    wedged = [f for f in result.findings if "(still retried at the deadline)" in f]
    assert wedged, text
    # (An attempt that met the lock in its fenced transaction is still unanswered; a later one
    # waited its 2 s for the record, and got 409 in flight.)
    assert all("generation" in f and "lease" in f for f in wedged), text
    assert all("unanswered for" in f or "409 request-in-flight" in f for f in wedged), text
    assert result.duplicate_effects == 0, text  # (a hold left by a stuck key is no double debit)


async def test_an_app_that_exits_ends_the_scenario_at_once(
    app: ServerProcess, bank: ServerProcess, hang_db: str, monkeypatch: Any
) -> None:
    """The app's process exits under load and nothing starts it again: the clients stop within
    a second or so, and the failure says the app exited, with its log's last lines. (Before:
    every key's 80 refused attempts, about 40 s each, in the load and again in the final pass.)"""
    monkeypatch.setattr(faults, "CLIENTS_DEADLINE", 120.0)

    async def crash() -> None:
        await asyncio.to_thread(app.kill)

    started = time.monotonic()
    result = await faults.under_load(
        app,
        bank,
        hang_db,
        "payouts",
        prefix="exited",
        inject=crash,
        times=1,
        rng=random.Random(8),
        concurrency=3,
        watch=app,
    )
    took = time.monotonic() - started
    assert took < 20, took
    assert not result.clean
    assert result.findings[0].startswith("the app exited (code -9); its log ends:"), (
        result.summary()
    )
