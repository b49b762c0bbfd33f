"""A route's mode changed by a rolling deploy (docs/lease-mode.md, "Changing a route's mode"):
processes of the old version and of the new one answer the same key on one database at once.

`POST /payouts` (tests/apps/lease.py) is served transactional by one app and in lease mode by
the other; its fenced write (a `test_ledger` row) is the claim's connection in transactional
mode, the fence in lease mode. Each key must be executed (its ledger row committed) once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import Mode, PostgresStore, RecordKey
from idem_middleware.ops import reopen
from idem_middleware.store.base import Claimed, Existing, Settlement, State, StoredResponse
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    Step,
    assert_problem,
    assert_replay_of,
    build_lease_app,
    client,
    count,
    downstream_reconciler,
    lock_waiters,
    wait_for_waiters,
)
from tests.integration.test_lease_mode import (
    bank,  # noqa: F401 (a fixture)
    finish,
    post,
    probe_of,
    row,
    spawn,
)

pytestmark = pytest.mark.db_routes("pgbouncer")

TRANSACTIONAL = LEASE_POLICY.replace(mode=Mode.TRANSACTIONAL)


async def test_a_lease_claim_during_an_old_transactional_execution_runs_once(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    db_route: str,
) -> None:
    """Old version transactional, new version lease mode. The transactional claim holds the
    key's claim lock until it commits, and the lease claim tries that lock: the key is busy, so
    the lease request waits (in the process, without a connection) and replays the
    transactional outcome. One ledger row. (It used to claim at once and run, and the
    transactional commit then met its record and rolled back: one execution too, but the
    memory store made the lease claim wait, and on the ordinary path, whose transactional claim
    writes its row early, the lease claim waited for that row inside PostgreSQL.)"""
    async with PostgresStore(pool=pool, listen=db_route != "pgbouncer") as new_store:
        old = build_lease_app(pg_store, bank, TRANSACTIONAL)
        new = build_lease_app(new_store, bank, LEASE_POLICY.replace(wait_seconds=BOUND))
        probe_old, probe_new = probe_of(old), probe_of(new)
        gate = asyncio.Event()
        probe_old.steps = [Step(downstream=False, fence="before", gate=gate)]
        async with client(old) as c_old, client(new) as c_new:
            task_old = spawn(post(c_old))
            await asyncio.wait_for(probe_old.entered.wait(), BOUND)
            task_new = spawn(post(c_new))
            await wait_for_waiters(new)
            assert await lock_waiters(bank) == 0
            gate.set()
            first = await finish(task_old)
            assert first.status_code == 201, first.text
            assert_replay_of(await finish(task_new), first)
    assert probe_new.calls == 0
    assert await count(bank, "test_ledger") == 1
    record = await row(bank)
    assert record is not None
    assert (record["state"], record["mode"]) == ("succeeded", "transactional")


async def test_an_old_lease_execution_is_in_flight_for_a_new_transactional_request(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    db_route: str,
) -> None:
    """Old version lease mode, new version transactional (a deploy rolled back, say): the lease
    record is `pending`, and the transactional request waits its `wait_seconds`, then answers
    409 and runs nothing; its retry gets the lease execution's replay, and a record written
    transactionally is replayed to a lease-mode request in turn (the fingerprint does not depend
    on the mode)."""
    async with PostgresStore(pool=pool, listen=db_route != "pgbouncer") as new_store:
        old = build_lease_app(pg_store, bank, LEASE_POLICY)
        new = build_lease_app(new_store, bank, TRANSACTIONAL)
        probe_old, probe_new = probe_of(old), probe_of(new)
        gate = asyncio.Event()
        probe_old.steps = [Step(fence="before", gate=gate)]
        probe_new.steps = [Step(downstream=False, fence="before")]
        async with client(old) as c_old, client(new) as c_new:
            task_old = spawn(post(c_old))
            await asyncio.wait_for(probe_old.entered.wait(), BOUND)
            busy = await asyncio.wait_for(post(c_new), BOUND)
            assert_problem(busy, 409, "request-in-flight")
            gate.set()
            first = await finish(task_old)
            assert first.status_code == 201, first.text
            assert_replay_of(await post(c_new), first)

            # The other way round: the transactional record answers the lease-mode request.
            fresh = await post(c_new, "k2")
            assert fresh.status_code == 201, fresh.text
            assert_replay_of(await post(c_old, "k2"), fresh)
    assert probe_new.calls == 1  # k2 only
    assert probe_old.calls == 1
    assert await count(bank, "test_ledger") == 2  # one per key


@pytest.mark.parametrize("ending", ["replayed", "unknown"])
async def test_a_transactional_request_waits_for_a_lease_execution_of_its_key(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    ending: str,
) -> None:
    """Found by probing: a transactional request (a deploy rolled back from lease mode, or two
    apps on one store) that met a lease-mode execution of its key answered `409
    request-in-flight` at once, whatever its `wait_seconds`: during the deploy a client's retry
    got a 409 where any other duplicate waits for the original and gets its replay. It now waits
    as a duplicate of a busy key does (in the process, holding no connection), then replays the
    outcome, or answers `409 outcome-unknown` if the execution lost it. Never runs it."""
    old = build_lease_app(pg_store, bank, LEASE_POLICY)
    new = build_lease_app(pg_store, bank, TRANSACTIONAL.replace(wait_seconds=BOUND))
    gate = asyncio.Event()
    fail = "late" if ending == "unknown" else None
    probe_of(old).steps = [Step(fence="before", gate=gate, fail=fail)]
    async with client(old) as c_old, client(new) as c_new:
        task_old = spawn(post(c_old))
        await asyncio.wait_for(probe_of(old).entered.wait(), BOUND)
        task_new = spawn(post(c_new))
        await wait_for_waiters(new)
        assert await lock_waiters(bank) == 0  # (it waits holding nothing in the database)
        gate.set()
        first = await finish(task_old)
        second = await finish(task_new)
    assert probe_of(new).calls == 0
    if ending == "unknown":
        assert first.status_code == 500
        assert_problem(second, 409, "outcome-unknown")
        assert await count(bank, "test_ledger") == 0  # (the fenced write rolled back)
    else:
        assert first.status_code == 201, first.text
        assert_replay_of(second, first)
        assert await count(bank, "test_ledger") == 1


async def test_a_lapsed_lease_is_never_run_by_a_transactional_request(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """An old lease-mode process died mid-request in the deploy; the new version serves the
    route transactionally. Its effect may have happened at the bank: the transactional request
    never runs it again. Found by probing: it answered `409 request-in-flight` (with a
    Retry-After, for a request nothing runs) until an operator ran `idem-middleware reconcile`,
    and the status resource said `"retry": true` of a record no retry moved. The request that
    finds the lapsed lease now marks it `unknown`, as a lease-mode retry does: `409
    outcome-unknown`, for an operator to resolve."""
    key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
    claim = await pg_store.claim_lease(key, b"-", retention_seconds=60, lease_seconds=60)
    assert isinstance(claim, Claimed)
    await bank.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
    )  # the old process's lease lapsed
    new = build_lease_app(pg_store, bank, TRANSACTIONAL)
    where = {"operation": f"POST {PAYOUTS}", "key": "k1"}
    async with client(new) as c:
        await bank.execute(
            "UPDATE idem_requests SET fingerprint = $1", await _fingerprint_of(c, bank)
        )
        before = (await c.get("/idempotency/status", params=where)).json()
        assert (before["state"], before["retry"]) == ("pending", True)
        assert "operator" in before["detail"]
        assert_problem(await post(c), 409, "outcome-unknown")
        after = (await c.get("/idempotency/status", params=where)).json()
        assert_problem(await post(c), 409, "outcome-unknown")
    assert (after["state"], after["retry"]) == ("unknown", False)
    assert probe_of(new).calls == 1  # the "probe" key's, none for k1
    assert await count(bank, "test_ledger") == 0
    record = await row(bank)
    assert record is not None
    assert record["state"] == "unknown"


async def test_a_record_released_for_a_retry_is_run_by_a_transactional_request(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """Found by probing: a lease-mode record an operator (or a reconciler) released for the
    client's retry stayed `pending` for good once its route was transactional: every retry
    answered `409 request-in-flight`, `reconcile` had no lapsed lease to act on, `resolve`
    refused a pending record, and the status resource said `"retry": true`. The retry now runs
    it, once; its writes and its outcome commit together."""
    key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
    claim = await pg_store.claim_lease(key, b"-", retention_seconds=60, lease_seconds=60)
    assert isinstance(claim, Claimed)
    assert await pg_store.settle(key, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await pg_store.allow_retry(key, claim.generation, "not at the bank")
    new = build_lease_app(pg_store, bank, TRANSACTIONAL)
    # The probe key's run, then k1's, each writing its ledger row in the claim's transaction.
    probe_of(new).steps = [Step(downstream=False), Step(downstream=False, fence="before")]
    where = {"operation": f"POST {PAYOUTS}", "key": "k1"}
    async with client(new) as c:
        await bank.execute(
            "UPDATE idem_requests SET fingerprint = $1", await _fingerprint_of(c, bank)
        )
        seen = (await c.get("/idempotency/status", params=where)).json()
        assert (seen["state"], seen["retry"]) == ("pending", True)
        first = await post(c)
        assert first.status_code == 201, first.text
        assert_replay_of(await post(c), first)
    assert probe_of(new).calls == 2  # the "probe" key's and k1's
    assert await count(bank, "test_ledger") == 1
    record = await row(bank)
    assert record is not None
    assert (record["state"], record["mode"]) == ("succeeded", "transactional")


async def _fingerprint_of(c: Any, pool: asyncpg.Pool[Any]) -> bytes:
    """The fingerprint this app computes for the test's request: read from a record it writes
    for another key (then deleted)."""
    response = await post(c, "probe")
    assert response.status_code == 201, response.text
    value: bytes = await pool.fetchval(
        "DELETE FROM idem_requests WHERE idem_key = 'probe' RETURNING fingerprint"
    )
    await pool.execute("DELETE FROM test_ledger")
    return value


async def test_a_reopened_transactional_record_is_never_reconciled_by_a_lease_route(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """Found by probing: a transactional request committed its write with its outcome; an
    operator reopened the record (`idem-middleware reopen`) and the route then moved to lease
    mode with a reconciler. The retry ran the reconciler, which (asking the bank about a
    downstream key the transactional run never sent) answered "not happened": the takeover
    took the record over and the handler ran again, a second ledger row. A transactional
    record's outcome is known by construction: no reconciler runs on it, and the retry answers
    `409 outcome-unknown` until an operator resolves it."""
    old = build_lease_app(pg_store, bank, TRANSACTIONAL)
    probe_of(old).steps = [Step(downstream=False, fence="before")]
    async with client(old) as c:
        first = await post(c)
        assert first.status_code == 201, first.text
    assert await count(bank, "test_ledger") == 1
    key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
    await reopen(pg_store, key, note="customer disputes it")
    new = build_lease_app(
        pg_store, bank, LEASE_POLICY.replace(reconciler=downstream_reconciler(bank))
    )
    where = {"operation": f"POST {PAYOUTS}", "key": "k1"}
    async with client(new) as c:
        seen = (await c.get("/idempotency/status", params=where)).json()
        assert_problem(await post(c), 409, "outcome-unknown")
        assert_problem(await post(c), 409, "outcome-unknown")
    assert (seen["state"], seen["retry"]) == ("unknown", False)
    assert probe_of(new).calls == 0
    assert await count(bank, "test_ledger") == 1
    record = await row(bank)
    assert record is not None
    assert (record["state"], record["mode"]) == ("unknown", "transactional")


async def test_a_lease_claim_does_not_wait_for_a_transaction_taking_a_released_record_over(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
) -> None:
    """Found by probing: while a transaction took over a record released for a retry (a route
    moved to transactional mode), a lease-mode claim of the key (an old process, in the deploy)
    waited in its INSERT for that transaction's row, with no bound, holding a pooled connection
    for as long as the handler ran. It now gets the record as last committed, at once. (Left
    as lease-mode.md says: the takeover its duplicate then tries waits for the row, holding a
    connection, bounded by its `wait_seconds`; in a storm those waits still fill a small pool.)"""
    key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
    fp = b"\x01" * 32
    claim = await pg_store.claim_lease(key, fp, retention_seconds=60, lease_seconds=60)
    assert isinstance(claim, Claimed)
    assert await pg_store.settle(key, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await pg_store.allow_retry(key, claim.generation, "not at the bank")
    async with pg_store.transaction(acquire_timeout=BOUND) as session:
        taken = await session.claim(key, fp, retention_seconds=60, wait_seconds=BOUND)
        assert isinstance(taken, Claimed)
        found = await asyncio.wait_for(
            pg_store.claim_lease(key, fp, retention_seconds=60, lease_seconds=60), BOUND
        )
        assert isinstance(found, Existing)
        assert found.record.retry_allowed
        await session.finish(State.SUCCEEDED, StoredResponse(201, [], b"{}"))
    record = await pg_store.get(key)
    assert record is not None
    assert (record.state, record.generation) == (State.SUCCEEDED, taken.generation)
