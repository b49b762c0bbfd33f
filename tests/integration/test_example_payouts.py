"""The example app's payouts over real HTTP (docs/example-app.md): lease mode, bank faults, crashes.

The app runs as a process on a fresh database, and the bank simulator as its OWN process, so the
bank's transfers outlive an app crash, as a real bank's would. Every case counts what matters:
transfers at the bank (GET /transfers) and debits in the app's database (rows in ex_payouts, and
the balance). The 202 path of §3 is not part of §7 and is not exercised here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from example_app.launcher import ServerProcess
from tests.conftest import _fresh_database

A = {"authorization": "Bearer demo-a"}
B = {"authorization": "Bearer demo-b"}
#: A tenant whose name has a colon, like the bank's "<tenant>:<account>".
C = {"authorization": "Bearer demo-c"}
TOKENS = "demo-a:tenant-a,demo-b:tenant-b,demo-c:org:acme"
LEASE_SECONDS = 1.5
BANK_TIMEOUT = 0.5


def key() -> str:
    return f'"{uuid.uuid4()}"'


def account_id() -> str:
    return f"acc-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
async def app_db(admin_dsn: str) -> str:
    return await _fresh_database(admin_dsn, "idem_example_payouts")


def app_env(app_db: str, bank: ServerProcess, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": app_db,
        "BANK_URL": bank.url,
        "EXAMPLE_LEASE_SECONDS": str(LEASE_SECONDS),
        "EXAMPLE_WAIT_SECONDS": "0.5",
        "EXAMPLE_BANK_TIMEOUT": str(BANK_TIMEOUT),
        "EXAMPLE_TOKENS": TOKENS,
        **extra,
    }


def serving(env: dict[str, str]) -> Iterator[ServerProcess]:
    """The example app, one process, with `env`; stopped after."""
    proc = ServerProcess("example_app", env=env, ready_path="/accounts/x")
    proc.start()
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="module")
def server(app_db: str, bank: ServerProcess) -> Iterator[ServerProcess]:
    yield from serving(app_env(app_db, bank))


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


class Ledger:
    """Counts, for one tenant's account, the bank's transfers and the app's debits."""

    def __init__(self, app_db: str, bank_http: httpx.AsyncClient) -> None:
        self.app_db = app_db
        self.bank_http = bank_http

    async def transfers(self, tenant: str, account: str) -> list[dict[str, Any]]:
        r = await self.bank_http.get("/transfers")
        assert r.status_code == 200
        # The app names the bank account "<tenant>:<account>".
        return [t for t in r.json() if t["account"] == f"{tenant}:{account}"]

    async def debits(self, tenant: str, account: str) -> int:
        conn = await asyncpg.connect(self.app_db)
        try:
            count: int = await conn.fetchval(
                "SELECT count(*) FROM ex_payouts WHERE tenant = $1 AND account_id = $2",
                tenant,
                account,
            )
            return count
        finally:
            await conn.close()

    async def record_state(self, tenant: str, idem_key: str) -> str | None:
        conn = await asyncpg.connect(self.app_db)
        try:
            state: str | None = await conn.fetchval(
                "SELECT state FROM idem_requests WHERE tenant = $1 AND operation = $2 "
                "AND idem_key = $3",
                tenant,
                "POST /payouts",
                idem_key.strip('"'),
            )
            return state
        finally:
            await conn.close()

    async def counts(self, tenant: str, account: str) -> tuple[int, int]:
        """(transfers at the bank, debits in the app)."""
        return len(await self.transfers(tenant, account)), await self.debits(tenant, account)


@pytest.fixture
def ledger(app_db: str, bank_http: httpx.AsyncClient) -> Ledger:
    return Ledger(app_db, bank_http)


async def fund(
    http: httpx.AsyncClient, account: str, amount: int, auth: dict[str, str] = A
) -> None:
    r = await http.post(
        f"/accounts/{account}/credits",
        json={"amount": amount},
        headers={**auth, "idempotency-key": key()},
    )
    assert r.status_code == 201, r.text


async def payout(
    http: httpx.AsyncClient, account: str, amount: int, k: str, auth: dict[str, str] = A
) -> httpx.Response:
    return await http.post(
        "/payouts",
        json={"account_id": account, "amount": amount},
        headers={**auth, "idempotency-key": k},
    )


async def balance(http: httpx.AsyncClient, account: str, auth: dict[str, str] = A) -> int:
    r = await http.get(f"/accounts/{account}", headers=auth)
    assert r.status_code == 200, r.text
    value: int = r.json()["balance"]
    return value


async def set_faults(bank_http: httpx.AsyncClient, **faults: int) -> None:
    assert (await bank_http.post("/_faults", json=faults)).status_code == 200


def assert_replay_of(replay: httpx.Response, original: httpx.Response) -> None:
    assert replay.status_code == original.status_code
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == original.json()


async def retry_until_settled(
    http: httpx.AsyncClient, account: str, amount: int, k: str
) -> httpx.Response:
    """Retry a payout while the answer is 409 (the previous executor's lease has not lapsed)."""
    async with asyncio.timeout(15):
        while True:
            r = await payout(http, account, amount, k)
            if r.status_code != 409:
                return r
            if r.json()["type"].endswith("request-in-flight"):
                assert "retry-after" in r.headers  # (an unknown outcome carries none)
            await asyncio.sleep(min(float(r.headers.get("retry-after", "0.2")), 0.5))


# --- the plain paths -----------------------------------------------------------------------


async def test_payout_succeeds_and_its_replay_moves_nothing(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    first = await payout(http, acc, 30, k)
    assert first.status_code == 201, first.text
    body = first.json()
    assert set(body) == {"payout_id", "account_id", "amount", "balance", "bank_transfer_id"}
    assert (body["account_id"], body["amount"], body["balance"]) == (acc, 30, 70)
    assert "idempotent-replayed" not in first.headers
    assert_replay_of(await payout(http, acc, 30, k), first)
    (transfer,) = await ledger.transfers("tenant-a", acc)
    assert transfer["transfer_id"] == body["bank_transfer_id"]
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await balance(http, acc) == 70
    reused = await payout(http, acc, 31, k)
    assert reused.status_code == 422
    assert await ledger.counts("tenant-a", acc) == (1, 1)


async def test_insufficient_funds_is_a_final_402_replayed(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    acc, k = account_id(), key()
    await fund(http, acc, 10)
    first = await payout(http, acc, 50, k)
    assert first.status_code == 402
    assert first.headers["content-type"] == "application/problem+json"
    assert_replay_of(await payout(http, acc, 50, k), first)
    # A final failure stays final: funds arriving later do not turn this key into a payout.
    await fund(http, acc, 100)
    assert_replay_of(await payout(http, acc, 50, k), first)
    assert await ledger.record_state("tenant-a", k) == "failed_final"
    assert await ledger.counts("tenant-a", acc) == (0, 0)
    assert await balance(http, acc) == 110


async def test_each_problem_says_its_kind_by_its_type(http: httpx.AsyncClient) -> None:
    """Found by probing: the app's problems were all `about:blank` with titles of their own
    (RFC 9457 wants the status's phrase there), so a client told insufficient funds from another
    402 by the title's words; and its 401 and the middleware's had two types for one problem."""
    acc = account_id()
    await fund(http, acc, 10)
    short = (await payout(http, acc, 50, key())).json()
    assert short["type"] == "urn:idem-example:problem:insufficient-funds"
    assert (short["title"], short["status"]) == ("Insufficient funds", 402)
    assert short["detail"]
    missing = (await http.get(f"/accounts/{account_id()}", headers=A)).json()
    assert (missing["type"], missing["title"], missing["status"]) == (
        "about:blank",
        "Not Found",
        404,
    )
    assert missing["detail"] == "no such account"
    unnamed = await http.get(f"/accounts/{acc}")
    guarded = await payout(http, acc, 5, key(), {})
    assert unnamed.status_code == guarded.status_code == 401
    assert unnamed.json()["type"] == guarded.json()["type"]
    assert unnamed.json()["title"] == guarded.json()["title"]


async def test_unknown_account_is_404_and_not_stored(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    acc, k = account_id(), key()
    missing = await payout(http, acc, 5, k)
    assert missing.status_code == 404
    assert await ledger.record_state("tenant-a", k) is None  # released: "fix and retry"
    # Once the account exists, the same key runs the payout for real.
    await fund(http, acc, 20)
    fixed = await payout(http, acc, 5, k)
    assert fixed.status_code == 201, fixed.text
    assert "idempotent-replayed" not in fixed.headers
    assert await ledger.counts("tenant-a", acc) == (1, 1)


async def test_payout_without_a_valid_token_is_401(http: httpx.AsyncClient, ledger: Ledger) -> None:
    acc = account_id()
    await fund(http, acc, 100)
    for auth in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic demo-a"}):
        r = await payout(http, acc, 10, key(), auth)
        assert r.status_code == 401, (auth, r.text)
    assert await ledger.counts("tenant-a", acc) == (0, 0)
    assert await balance(http, acc) == 100


async def test_tenants_are_isolated(http: httpx.AsyncClient, ledger: Ledger) -> None:
    acc, k = account_id(), key()
    await fund(http, acc, 100)  # tenant-a's account
    # tenant-b cannot pay out of tenant-a's account: for tenant-b it does not exist.
    stolen = await payout(http, acc, 10, key(), B)
    assert stolen.status_code == 404
    assert await ledger.counts("tenant-b", acc) == (0, 0)
    assert await balance(http, acc) == 100
    # The same key under each tenant is two operations, each executed once.
    a = await payout(http, acc, 30, k, A)
    await fund(http, acc, 50, B)  # tenant-b's own account of the same name
    b = await payout(http, acc, 20, k, B)
    assert (a.status_code, b.status_code) == (201, 201)
    assert "idempotent-replayed" not in b.headers
    assert a.json()["bank_transfer_id"] != b.json()["bank_transfer_id"]
    assert (a.json()["balance"], b.json()["balance"]) == (70, 30)
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await ledger.counts("tenant-b", acc) == (1, 1)
    # Two downstream keys: the bank never sees the tenants' keys collide.
    (ta,) = await ledger.transfers("tenant-a", acc)
    (tb,) = await ledger.transfers("tenant-b", acc)
    assert ta["idempotency_key"] != tb["idempotency_key"]


# --- bank faults ---------------------------------------------------------------------------


async def test_lost_bank_answer_is_reconciled_without_paying_twice(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """fail_after_record: the bank moved the money, its answer is lost."""
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    await set_faults(bank_http, fail_after_record=500)
    lost = await payout(http, acc, 30, k)
    assert lost.status_code == 502
    assert await ledger.record_state("tenant-a", k) == "unknown"
    assert await ledger.counts("tenant-a", acc) == (1, 0)  # money moved, debit rolled back
    # Retry while the fault is still active: the retry asks the bank (a GET) and never POSTs.
    reconciled = await payout(http, acc, 30, k)
    assert reconciled.status_code == 201, reconciled.text
    (transfer,) = await ledger.transfers("tenant-a", acc)
    assert reconciled.json()["bank_transfer_id"] == transfer["transfer_id"]
    assert reconciled.json()["balance"] == 70
    await set_faults(bank_http)
    assert_replay_of(await payout(http, acc, 30, k), reconciled)
    assert await ledger.record_state("tenant-a", k) == "succeeded"
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await balance(http, acc) == 70


async def test_money_a_lost_payout_may_have_sent_stays_held(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """Found by probing: the debit of a payout whose bank answer was lost rolled back, so a
    second payout spent the same money (201), and the first one's retry, reconciled, took the
    balance to -100: 200 sent from an account holding 100. The money stays held now."""
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    await set_faults(bank_http, fail_after_record=500)
    lost = await payout(http, acc, 100, k)
    assert lost.status_code == 502
    await set_faults(bank_http)
    assert await balance(http, acc) == 0  # held: it may have left
    other = await payout(http, acc, 100, key())
    assert other.status_code == 402, other.text
    reconciled = await payout(http, acc, 100, k)
    assert reconciled.status_code == 201, reconciled.text
    assert reconciled.json()["balance"] == 0
    assert await balance(http, acc) == 0
    assert await ledger.counts("tenant-a", acc) == (1, 1)


async def test_a_payout_run_again_keeps_its_own_hold(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """Reconciled as not having happened, the payout runs again: it holds its money once."""
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    await set_faults(bank_http, fail_status=503)
    assert (await payout(http, acc, 60, k)).status_code == 502
    assert (await payout(http, acc, 60, k)).status_code == 502  # run again, refused again
    assert await balance(http, acc) == 40
    await set_faults(bank_http)
    ran = await payout(http, acc, 60, k)
    assert ran.status_code == 201, ran.text
    assert ran.json()["balance"] == 40
    assert await ledger.counts("tenant-a", acc) == (1, 1)


async def test_a_201_from_the_bank_that_is_no_transfer_is_a_lost_answer(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """Found by probing: a 201 whose body named no transfer (an error page's) raised KeyError
    in the handler, a plain-text 500; it is a lost answer (502), reconciled by the retry."""
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    await set_faults(bank_http, fail_after_record=201)
    odd = await payout(http, acc, 10, k)
    assert odd.status_code == 502, odd.text
    assert odd.headers["content-type"] == "application/problem+json"
    await set_faults(bank_http)
    reconciled = await payout(http, acc, 10, k)
    assert reconciled.status_code == 201, reconciled.text
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await balance(http, acc) == 90


async def test_bank_slower_than_the_timeout_is_reconciled(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """delay_ms beyond EXAMPLE_BANK_TIMEOUT: the app gives up, the money has moved."""
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    await set_faults(bank_http, delay_ms=int(BANK_TIMEOUT * 1000 * 3))
    started = time.monotonic()
    timed_out = await payout(http, acc, 40, k)
    assert timed_out.status_code == 502
    assert time.monotonic() - started < BANK_TIMEOUT * 3  # the app's timeout, not the bank's
    assert await ledger.record_state("tenant-a", k) == "unknown"
    reconciled = await payout(http, acc, 40, k)  # the delay is still active
    assert reconciled.status_code == 201, reconciled.text
    assert reconciled.json()["balance"] == 60
    await set_faults(bank_http)
    assert_replay_of(await payout(http, acc, 40, k), reconciled)
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await balance(http, acc) == 60


async def test_bank_refusal_records_nothing_and_the_retry_runs_again(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """fail_status: the bank answers an error and records nothing."""
    acc, k = account_id(), key()
    await fund(http, acc, 100)
    await set_faults(bank_http, fail_status=503)
    refused = await payout(http, acc, 25, k)
    assert refused.status_code == 502
    assert await ledger.record_state("tenant-a", k) == "unknown"
    # Retry while the bank still refuses: reconciled as NotHappened, run again, refused again.
    again = await payout(http, acc, 25, k)
    assert again.status_code == 502
    assert await ledger.counts("tenant-a", acc) == (0, 0)
    await set_faults(bank_http)
    ran = await payout(http, acc, 25, k)
    assert ran.status_code == 201, ran.text
    assert "idempotent-replayed" not in ran.headers  # a fresh execution, not a replay
    assert_replay_of(await payout(http, acc, 25, k), ran)
    assert await ledger.counts("tenant-a", acc) == (1, 1)
    assert await balance(http, acc) == 75


# --- crashes and restarts ------------------------------------------------------------------


async def test_app_killed_during_the_bank_call_is_reconciled_after_restart(
    app_db: str, bank: ServerProcess, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """SIGKILL while the handler waits on the bank; restart; the retry settles it once."""
    # A bank timeout longer than the delay: the handler is still in the bank call when killed.
    app = ServerProcess(
        "example_app", env=app_env(app_db, bank, EXAMPLE_BANK_TIMEOUT="10"), ready_path="/x"
    )
    acc, k = account_id(), key()
    try:
        app.start()
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            await fund(c, acc, 100)
            await set_faults(bank_http, delay_ms=3000)
            in_flight = asyncio.create_task(payout(c, acc, 45, k))
            # The bank records before it delays: once the transfer shows, the handler is
            # inside the bank call.
            for _ in range(500):  # up to ~10 s
                if await ledger.transfers("tenant-a", acc):
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the payout never reached the bank")
            assert await ledger.record_state("tenant-a", k) == "pending"
            app.kill()
            with pytest.raises(httpx.TransportError):
                await in_flight
        assert await ledger.counts("tenant-a", acc) == (1, 0)  # paid, not yet debited
        # From here on the bank refuses every new transfer: only reconciliation (a GET) can
        # settle the retry, so a 201 proves the payout was not executed a second time.
        await set_faults(bank_http, fail_status=503)
        app.start()
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            settled = await retry_until_settled(c, acc, 45, k)
            assert settled.status_code == 201, settled.text
            (transfer,) = await ledger.transfers("tenant-a", acc)
            assert settled.json()["bank_transfer_id"] == transfer["transfer_id"]
            assert_replay_of(await payout(c, acc, 45, k), settled)
            assert await balance(c, acc) == 55
        assert await ledger.record_state("tenant-a", k) == "succeeded"
        assert await ledger.counts("tenant-a", acc) == (1, 1)
    finally:
        app.cleanup()


async def test_restart_keeps_stored_responses(
    app_db: str, bank: ServerProcess, ledger: Ledger
) -> None:
    app = ServerProcess("example_app", env=app_env(app_db, bank), ready_path="/x")
    acc, paid, declined = account_id(), key(), key()
    try:
        app.start()
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            await fund(c, acc, 100)
            first_paid = await payout(c, acc, 60, paid)
            first_declined = await payout(c, acc, 60, declined)  # only 40 left
        assert (first_paid.status_code, first_declined.status_code) == (201, 402)
        app.stop()
        app.start()
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            assert_replay_of(await payout(c, acc, 60, paid), first_paid)
            assert_replay_of(await payout(c, acc, 60, declined), first_declined)
            assert await balance(c, acc) == 40
        assert await ledger.counts("tenant-a", acc) == (1, 1)
    finally:
        app.cleanup()


async def test_a_key_reused_after_its_retention_is_a_new_payout_at_the_bank_too(
    http: httpx.AsyncClient, ledger: Ledger, app_db: str
) -> None:
    """Issue 19, item 2: past retention the same key is a new request, so the bank must be sent
    a new downstream key. With the old key (derived from the key space only) the bank
    deduplicated the second payout into the first transfer, the debit then violated
    UNIQUE(bank_transfer_id), and every retry answered 409 outcome-unknown for good."""
    account = account_id()
    await fund(http, account, 1000)
    k = key()
    first = await payout(http, account, 100, k)
    assert first.status_code == 201, first.text

    conn = await asyncpg.connect(app_db)
    try:
        # Retention over, then purged: the key is forgotten.
        await conn.execute(
            "UPDATE idem_requests SET expires_at = now() - interval '1 second' WHERE idem_key = $1",
            k.strip('"'),
        )
        await conn.execute(
            "DELETE FROM idem_requests WHERE idem_key = $1 AND expires_at <= now()", k.strip('"')
        )
    finally:
        await conn.close()

    second = await payout(http, account, 100, k)
    assert second.status_code == 201, second.text
    assert "idempotent-replayed" not in second.headers
    assert second.json()["bank_transfer_id"] != first.json()["bank_transfer_id"]
    transfers = await ledger.transfers("tenant-a", account)
    assert len({t["idempotency_key"] for t in transfers}) == 2
    assert await ledger.counts("tenant-a", account) == (2, 2), "one debit per transfer"
    assert await balance(http, account) == 800
    assert_replay_of(await payout(http, account, 100, k), second)


async def test_a_tenant_with_a_colon_is_reconciled_on_its_own_account(
    http: httpx.AsyncClient, bank_http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """Found by probing: the reconciler read the account from the bank's "<tenant>:<account>"
    by splitting at the first colon. For tenant `org:acme` that named account `acme:x`: the
    reconciled payout debited another account of the tenant, or (none such) failed on every
    retry and left the money moved and the record unknown."""
    acc = account_id()
    other = f"acme:{acc}"
    await fund(http, acc, 100, C)
    await fund(http, other, 100, C)
    k = key()
    await set_faults(bank_http, fail_after_record=500)
    assert (await payout(http, acc, 30, k, C)).status_code == 502
    reconciled = await payout(http, acc, 30, k, C)
    assert reconciled.status_code == 201, reconciled.text
    assert await ledger.counts("org:acme", acc) == (1, 1)
    assert await ledger.debits("org:acme", other) == 0
    assert (await balance(http, acc, C), await balance(http, other, C)) == (70, 100)


async def test_an_account_id_the_database_cannot_keep_is_422_not_unknown(
    http: httpx.AsyncClient, ledger: Ledger
) -> None:
    """Found by probing: a NUL in the payout's account id was a 500 from PostgreSQL, so in lease
    mode the record became unknown, and every retry asked the bank and failed again."""
    k = key()
    refused = await payout(http, "acc\x00", 5, k)
    assert refused.status_code == 422, refused.text
    assert await ledger.record_state("tenant-a", k) is None  # released
