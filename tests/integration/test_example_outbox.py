"""The example app's transactional outbox over real HTTP: one event per effect, applied once.

The app runs as a process on a fresh database and the bank simulator (the events' consumer,
`POST /webhooks`) as its own process. Each credit emits `credit:{credit_id}` in the claim's
transaction, each payout `payout:{payout_id}` in the fenced transaction of its debit. What is
counted: events in `idem_outbox` (by the payload's account), and deliveries and applied event ids
at the bank (`GET /webhooks`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from example_app.launcher import ROOT, ServerProcess
from tests.conftest import _fresh_database
from tests.evidence import record

A = {"authorization": "Bearer demo-a"}
LEASE_SECONDS = 1.5
BANK_TIMEOUT = 0.5
#: The in-app publisher idles 1 s between empty polls: an event is applied well within this.
DELIVERY_SECONDS = 10.0
READY = "/accounts/x"  # 401 without a token: any answer means the server is up


def key() -> str:
    return f'"{uuid.uuid4()}"'


def account_id() -> str:
    return f"acc-{uuid.uuid4().hex[:10]}"


def app_env(dsn: str, bank: ServerProcess, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": dsn,
        "BANK_URL": bank.url,
        "EXAMPLE_LEASE_SECONDS": str(LEASE_SECONDS),
        "EXAMPLE_WAIT_SECONDS": "0.5",
        "EXAMPLE_BANK_TIMEOUT": str(BANK_TIMEOUT),
        **extra,
    }


@pytest.fixture(scope="module")
async def app_db(admin_dsn: str) -> str:
    return await _fresh_database(admin_dsn, "idem_example_outbox")


@pytest.fixture(scope="module")
def server(app_db: str, bank: ServerProcess) -> Iterator[ServerProcess]:
    """The app with its in-app publisher (EXAMPLE_PUBLISH defaults to on)."""
    proc = ServerProcess("example_app", env=app_env(app_db, bank), ready_path=READY).start()
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture
async def http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
async def bank_http(bank: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    """The bank's client; faults are cleared before and after every test."""
    async with httpx.AsyncClient(base_url=bank.url, timeout=30) as c:
        assert (await c.post("/_faults", json={})).status_code == 200
        yield c
        assert (await c.post("/_faults", json={})).status_code == 200


async def credit(
    http: httpx.AsyncClient, account: str, amount: int, k: str | None = None
) -> httpx.Response:
    return await http.post(
        f"/accounts/{account}/credits",
        json={"amount": amount},
        headers={**A, "idempotency-key": k or key()},
    )


async def payout(http: httpx.AsyncClient, account: str, amount: int, k: str) -> httpx.Response:
    return await http.post(
        "/payouts",
        json={"account_id": account, "amount": amount},
        headers={**A, "idempotency-key": k},
    )


async def events_of(dsn: str, account: str) -> list[dict[str, Any]]:
    """The outbox events about one account, oldest first."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT event_id, tenant, topic, payload::text AS payload, sent_at IS NOT NULL AS sent "
            "FROM idem_outbox WHERE payload->>'account_id' = $1 ORDER BY created_at",
            account,
        )
    finally:
        await conn.close()
    return [{**dict(r), "payload": json.loads(r["payload"])} for r in rows]


async def outbox_counts(dsn: str) -> tuple[int, int]:
    """(events, unsent events) in the whole outbox."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS events, count(*) FILTER (WHERE sent_at IS NULL) AS unsent "
            "FROM idem_outbox"
        )
        assert row is not None
        return row["events"], row["unsent"]
    finally:
        await conn.close()


async def webhooks(bank_http: httpx.AsyncClient) -> dict[str, Any]:
    r = await bank_http.get("/webhooks")
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


async def wait_applied(
    bank_http: httpx.AsyncClient, dsn: str, account: str, event_ids: set[str]
) -> dict[str, Any]:
    """Wait (bounded) until the bank applied these events and the outbox marked them sent."""
    async with asyncio.timeout(DELIVERY_SECONDS):
        while True:
            hooks = await webhooks(bank_http)
            sent = {e["event_id"] for e in await events_of(dsn, account) if e["sent"]}
            if event_ids <= set(hooks["applied"]) and event_ids <= sent:
                return hooks
            await asyncio.sleep(0.05)


# --- the in-app publisher -------------------------------------------------------------------


async def test_a_credit_and_a_payout_each_deliver_one_event(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, app_db: str
) -> None:
    acc = account_id()
    funded = await credit(http, acc, 100)
    assert funded.status_code == 201, funded.text
    paid = await payout(http, acc, 30, key())
    assert paid.status_code == 201, paid.text
    credit_event = f"credit:{funded.json()['credit_id']}"
    payout_event = f"payout:{paid.json()['payout_id']}"
    hooks = await wait_applied(bank_http, app_db, acc, {credit_event, payout_event})
    assert hooks["applied"].count(credit_event) == hooks["applied"].count(payout_event) == 1
    events = await events_of(app_db, acc)
    assert [(e["event_id"], e["topic"], e["tenant"]) for e in events] == [
        (credit_event, "credit.created", "tenant-a"),
        (payout_event, "payout.created", "tenant-a"),
    ]
    assert events[0]["payload"] == {
        "credit_id": funded.json()["credit_id"],
        "account_id": acc,
        "amount": 100,
        "memo": None,
    }
    assert events[1]["payload"] == paid.json()


async def test_a_replayed_credit_emits_no_second_event(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, app_db: str
) -> None:
    acc, k = account_id(), key()
    first = await credit(http, acc, 25, k)
    again = await credit(http, acc, 25, k)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    event = f"credit:{first.json()['credit_id']}"
    hooks = await wait_applied(bank_http, app_db, acc, {event})
    assert hooks["applied"].count(event) == 1
    assert [e["event_id"] for e in await events_of(app_db, acc)] == [event]


async def test_a_final_402_and_a_rolled_back_credit_emit_nothing(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, app_db: str
) -> None:
    # 402: a final failure commits the fenced transaction (the stored 402) with no debit, so
    # no payout event; replayed, it emits nothing either.
    acc = account_id()
    funded = await credit(http, acc, 10)
    k = key()
    declined = await payout(http, acc, 50, k)
    assert declined.status_code == 402
    assert (await payout(http, acc, 50, k)).headers["idempotent-replayed"] == "true"
    # A refusal after the writes, in transactional mode: the credit's row and its event were
    # written, then the balance overflows bigint (a 422, as a 500 would be once the app catches
    # nothing); the claim's transaction rolls back, event included.
    big = account_id()
    ok = await credit(http, big, 2**62)
    assert ok.status_code == 201, ok.text
    overflow = await credit(http, big, 2**62)
    assert overflow.status_code == 422, overflow.text
    # A payout on an account the tenant does not have: 404, released, nothing written.
    assert (await payout(http, account_id(), 5, key())).status_code == 404
    expected = {
        acc: [f"credit:{funded.json()['credit_id']}"],
        big: [f"credit:{ok.json()['credit_id']}"],
    }
    for account, ids in expected.items():
        await wait_applied(bank_http, app_db, account, set(ids))
        assert [e["event_id"] for e in await events_of(app_db, account)] == ids
    conn = await asyncpg.connect(app_db)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM ex_credits WHERE account_id = $1", big)
    finally:
        await conn.close()
    assert rows == 1


async def test_a_reconciled_payout_emits_exactly_one_event(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, app_db: str
) -> None:
    """The reconciler's Happened path debits through the same `debit()`: one event, once."""
    acc, k = account_id(), key()
    assert (await credit(http, acc, 100)).status_code == 201
    assert (await bank_http.post("/_faults", json={"fail_after_record": 500})).status_code == 200
    lost = await payout(http, acc, 30, k)
    assert lost.status_code == 502
    assert [e["topic"] for e in await events_of(app_db, acc)] == ["credit.created"]
    reconciled = await payout(http, acc, 30, k)  # asks the bank, finds the transfer
    assert reconciled.status_code == 201, reconciled.text
    replay = await payout(http, acc, 30, k)
    assert replay.headers["idempotent-replayed"] == "true"
    event = f"payout:{reconciled.json()['payout_id']}"
    hooks = await wait_applied(bank_http, app_db, acc, {event})
    assert hooks["applied"].count(event) == 1
    payouts = [e for e in await events_of(app_db, acc) if e["topic"] == "payout.created"]
    assert [e["event_id"] for e in payouts] == [event]
    assert payouts[0]["payload"] == reconciled.json()


# --- the CLI publisher, killed between sending and marking -----------------------------------


def publisher_argv(bank: ServerProcess, *extra: str) -> list[str]:
    url = bank.url + "/webhooks"
    return [sys.executable, "-m", "idem_middleware.cli", "outbox", "publish", "--url", url, *extra]


async def test_a_publisher_killed_after_sending_redelivers_and_the_bank_applies_once(
    admin_dsn: str,
) -> None:
    dsn = await _fresh_database(admin_dsn, "idem_example_outbox_cli")
    bank = ServerProcess("example_app.bank", ready_path="/webhooks")
    no_publisher = app_env(dsn, bank, EXAMPLE_PUBLISH="0")
    app = ServerProcess("example_app", env=no_publisher, ready_path=READY)
    env = {**os.environ, "IDEM_DATABASE_URL": dsn}
    publisher: subprocess.Popen[bytes] | None = None
    try:
        bank.start()
        app.start()
        async with (
            httpx.AsyncClient(base_url=app.url, timeout=30) as http,
            httpx.AsyncClient(base_url=bank.url, timeout=30) as bank_http,
        ):
            acc = account_id()
            assert (await credit(http, acc, 100)).status_code == 201
            assert (await credit(http, acc, 5)).status_code == 201
            assert (await payout(http, acc, 30, key())).status_code == 201
            events, _ = await outbox_counts(dsn)
            assert events == 3
            await asyncio.sleep(1.5)  # no publisher in the app: nothing reaches the bank
            assert await webhooks(bank_http) == {"deliveries": 0, "applied": []}

            faults = {"webhook_delay_ms": 60_000}
            assert (await bank_http.post("/_faults", json=faults)).status_code == 200
            publisher = subprocess.Popen(  # noqa: ASYNC220 -- started once, never awaited
                # An event it is sending when killed is reserved for 2.5 s, then sent again.
                publisher_argv(
                    bank,
                    "--idle-seconds",
                    "0.2",
                    "--send-timeout",
                    "2",
                    "--reservation-margin",
                    "0.5",
                ),
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            async with asyncio.timeout(20):
                while not (hooks := await webhooks(bank_http))["deliveries"]:
                    assert publisher.poll() is None, "the publisher exited"
                    await asyncio.sleep(0.02)
            # The bank applied the first event and holds its answer: nothing is marked sent.
            assert hooks["deliveries"] == len(hooks["applied"]) == 1
            assert await outbox_counts(dsn) == (3, 3)
            os.killpg(publisher.pid, signal.SIGKILL)
            publisher.wait(10)
            assert (await bank_http.post("/_faults", json={})).status_code == 200

            runs: list[dict[str, int]] = []
            for _ in range(20):  # bounded: the dead publisher's reservation lapses (2.5 s)
                done = await asyncio.to_thread(
                    subprocess.run,
                    publisher_argv(bank, "--once"),
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert done.returncode == 0, done.stderr
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                if (await outbox_counts(dsn))[1] == 0:
                    break
                await asyncio.sleep(0.2)
            final = await webhooks(bank_http)
        conn = await asyncpg.connect(dsn)
        try:
            ids = {r["event_id"] for r in await conn.fetch("SELECT event_id FROM idem_outbox")}
        finally:
            await conn.close()
        counts = {
            "events": events,
            "deliveries": final["deliveries"],
            "redelivered": final["deliveries"] - len(set(final["applied"])),
            "applied": len(final["applied"]),
            "publisher_runs": len(runs),
        }
        print(f"\noutbox, publisher killed between sending and marking: {counts}")
        record(
            "outbox publisher killed after sending",
            requests=final["deliveries"],
            duplicate_effects=len(final["applied"]) - len(set(final["applied"])),
            lost_outcomes=len(ids - set(final["applied"])),
            stuck_keys=(await outbox_counts(dsn))[1],
            details=counts,
        )
        assert await outbox_counts(dsn) == (3, 0)
        assert sum(run["sent"] for run in runs) == 3
        assert sum(run["failed"] for run in runs) == 0
        # The killed publisher's delivery, then all three again: four deliveries, and the
        # first event applied once although it arrived twice.
        assert final["applied"][0] == hooks["applied"][0]
        assert sorted(final["applied"]) == sorted(ids)
        assert (counts["deliveries"], counts["redelivered"], counts["applied"]) == (4, 1, 3)
    finally:
        if publisher is not None and publisher.poll() is None:
            os.killpg(publisher.pid, signal.SIGKILL)
            publisher.wait(10)
        app.cleanup()
        bank.cleanup()
