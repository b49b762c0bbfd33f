"""Behaviours of the PostgreSQL store, the operators' commands, tokens, jobs, the status
resource and the outbox that no test pinned before (a run of hand-made mutations survived each
of them): a tenant's claim and reads see only its own records; a token released on another
operation stays used; a sent event is never sent again; an operator's move is refused once the
execution renewed or settled the record; a reopened lease record is settled by hand only; a
job's keyword order is the same call; a lease job released for a retry runs again; the status
of an expired record is not found; lapsed leases of takeover routes are left to their routes;
a finished record is never taken over; the outbox's listing and counts keep their states apart.
Each docstring names the statement or check it pins."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, PostgresStore, idempotent
from idem_middleware.context import token_hash
from idem_middleware.jobs import idempotent_job
from idem_middleware.ops import Resolution, reconcile_unknown, reopen, resolve
from idem_middleware.outbox import (
    OutboxEvent,
    Publisher,
    add,
    list_events,
    outbox_stats,
)
from idem_middleware.reconcile import Happened
from idem_middleware.status import status_route
from idem_middleware.store.base import (
    Claimed,
    Existing,
    RecordKey,
    Settlement,
    State,
    StoredResponse,
    TokenRefused,
)
from idem_middleware.tokens import TokenConflict, TokenIssuer
from tests.apps import BearerBackend, client

OP = "POST /payouts"
OTHER_OP = "POST /refunds"
FINGERPRINT = b"\x01" * 32
DONE = StoredResponse(201, [], b"{}")


async def _claim_with_token(store: PostgresStore, key: RecordKey, token: str) -> Any:
    return await store.claim_lease(
        key,
        FINGERPRINT,
        retention_seconds=0.05,
        lease_seconds=30,
        token_hash=token_hash(token),
    )


async def test_releasing_the_same_key_on_another_operation_keeps_the_token_used(
    pg_store: PostgresStore, pool: Any
) -> None:
    """queries.sql `release`: `t.operation = $2` in `restored` (S10). A client that sends its
    token as a plain key on another route, where the request is released (a 4xx to fix and
    retry), must not make the token usable again on its own route."""
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id="pay-2", ttl_seconds=300)).token
    key = RecordKey("tenant-a", OP, token)
    first = await _claim_with_token(pg_store, key, token)
    assert isinstance(first, Claimed)
    assert await pg_store.settle(
        key, first.generation, State.PENDING, Settlement(State.SUCCEEDED, DONE)
    )
    # The same string as a plain key on another route, released there.
    other = RecordKey("tenant-a", OTHER_OP, token)
    plain = await pg_store.claim_lease(other, FINGERPRINT, retention_seconds=60, lease_seconds=30)
    assert isinstance(plain, Claimed)
    assert await pg_store.release(other, plain.generation)
    consumed = await pool.fetchval(
        "SELECT consumed_at IS NOT NULL FROM idem_tokens WHERE tenant = $1 AND operation = $2",
        "tenant-a",
        OP,
    )
    assert consumed is True
    await asyncio.sleep(0.2)  # the token's record's retention is over
    again = await _claim_with_token(pg_store, key, token)
    assert isinstance(again, TokenRefused), again  # (the mutant reclaims it: it runs twice)


async def test_a_sent_event_is_not_sent_again_once_its_reservation_lapses(
    pg_store: PostgresStore, pool: Any
) -> None:
    """queries.sql `outbox_claim`: `sent_at IS NULL` (S13). A delivered event's reservation
    lapses like any other: it must never be reserved and sent again."""
    sent: list[str] = []

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.event_id)
        return True

    async with pool.acquire() as conn, conn.transaction():
        event_id = await add(conn, "payout.created", {"id": 1}, tenant="tenant-a")
    publisher = Publisher(pool, sender, send_timeout_seconds=0.05, reservation_margin_seconds=0.05)
    assert (await publisher.publish_batch()).sent == 1
    await asyncio.sleep(0.3)  # its reservation (0.1 s) lapsed
    assert (await publisher.publish_batch()).sent == 0
    assert sent == [event_id]


async def _lapsed_lease_record(store: PostgresStore, key: RecordKey) -> int:
    claim = await store.claim_lease(key, FINGERPRINT, retention_seconds=60, lease_seconds=0.05)
    assert isinstance(claim, Claimed)
    await asyncio.sleep(0.15)  # its lease lapsed (its process paused, or died)
    record = await store.get(key)
    assert record is not None
    assert record.lease_expired
    return claim.generation


async def test_an_operator_move_is_refused_once_a_lapsed_lease_is_renewed_again(
    pg_store: PostgresStore,
) -> None:
    """queries.sql `amend`: the pending lease-mode guard (S23). An operator read the record
    with its lease lapsed; its execution was only slow and renewed its lease since: the move
    (here to an outcome) must be refused, not settle a record a handler still runs."""
    key = RecordKey("tenant-a", OP, "slow-1")
    generation = await _lapsed_lease_record(pg_store, key)
    assert await pg_store.heartbeat(key, generation, 30)  # the execution renews it
    moved = await pg_store.amend(
        key,
        generation,
        State.PENDING,
        Settlement(State.SUCCEEDED, DONE, note="resolve pending -> succeeded 201: by hand"),
    )
    assert moved is False
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.PENDING


async def test_a_reopened_lease_record_is_settled_by_hand_only(pg_store: PostgresStore) -> None:
    """queries.sql `amend`: `reopened_generation` (S25). A lease-mode record an operator
    reopened may have committed writes with its outcome: no reconciler runs on it."""
    key = RecordKey("tenant-a", OP, "reopened-1")
    claim = await pg_store.claim_lease(key, FINGERPRINT, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await pg_store.settle(
        key, claim.generation, State.PENDING, Settlement(State.SUCCEEDED, DONE)
    )
    await reopen(pg_store, key, note="the payout bounced")
    summary = await pg_store.describe(key)
    assert summary is not None
    assert summary.state is State.UNKNOWN
    assert summary.by_hand
    asked: list[Any] = []

    async def reconciler(ctx: Any) -> Happened:
        asked.append(ctx)
        return Happened(201, b"{}")

    report = await reconcile_unknown(pg_store, {OP: reconciler})
    assert asked == []
    assert report.by_hand == {OP: 1}
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.UNKNOWN


async def test_a_job_repeated_with_its_keywords_in_another_order_is_a_repeat(
    pg_store: PostgresStore,
) -> None:
    """jobs.py `_fingerprint`: `OPT_SORT_KEYS` (J3). The same call with its keyword arguments
    (or a dict argument's keys) in another order is the same call: replayed, not JobKeyReused."""
    runs: list[str] = []

    @idempotent_job(pg_store, operation="invoices.send", key="invoice_id")
    async def send_invoice(job: Any, invoice_id: str, amount: int, meta: dict[str, Any]) -> Any:
        runs.append(invoice_id)
        return {"sent": invoice_id, "amount": amount}

    first = await send_invoice(invoice_id="inv-1", amount=5, meta={"a": 1, "b": 2})
    again = await send_invoice(meta={"b": 2, "a": 1}, amount=5, invoice_id="inv-1")
    assert first == again == {"sent": "inv-1", "amount": 5}
    assert runs == ["inv-1"]


async def test_a_lease_job_an_operator_released_for_a_retry_runs_on_its_next_call(
    pg_store: PostgresStore,
) -> None:
    """jobs_lease.py `run_leased`: `record.retry_allowed` takes the record over (J5). An unknown
    run that an operator decided did not happen (resolve --to retry) is run by the next call,
    not waited for until JobInProgress (the key wedged)."""

    runs: list[str] = []

    @idempotent_job(
        pg_store, operation="payouts.send", key="payout_id", mode="lease", wait_seconds=1
    )
    async def send_payout(job: Any, payout_id: str) -> Any:
        runs.append(payout_id)
        if len(runs) == 1:
            raise RuntimeError("the bank timed out")  # its outcome is unknown
        return {"sent": payout_id}

    with pytest.raises(RuntimeError):
        await send_payout(payout_id="p-1")
    key = RecordKey("", "payouts.send", "p-1")
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.UNKNOWN
    await resolve(pg_store, key, Resolution.RETRY, note="the bank has no such payout")
    assert await send_payout(payout_id="p-1") == {"sent": "p-1"}
    assert runs == ["p-1", "p-1"]


def _status_app(store: PostgresStore) -> Any:
    async def reconcile(ctx: Any) -> Any:
        raise AssertionError("a status read never reconciles")

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    return Starlette(
        routes=[
            Route(
                "/payouts",
                idempotent(mode=Mode.LEASE, reconciler=reconcile)(pay),
                methods=["POST"],
            ),
            status_route(store),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )


async def test_the_status_of_a_record_past_its_retention_is_not_found(
    pg_store: PostgresStore,
) -> None:
    """status.py: `record.expired` (T1). A record whose retention is over (not purged yet) is
    gone for the client: a retry with its key runs the request again, so the status must not
    still report its old outcome."""
    op = "POST /payouts"
    key = RecordKey("tenant-a", op, "old")
    claim = await pg_store.claim_lease(key, FINGERPRINT, retention_seconds=0.05, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await pg_store.settle(
        key, claim.generation, State.PENDING, Settlement(State.SUCCEEDED, DONE)
    )
    await asyncio.sleep(0.2)
    async with client(_status_app(pg_store)) as c:
        r = await c.get("/idempotency/status", params={"operation": op, "key": "old"})
    assert r.status_code == 404, r.text
    assert "record-not-found" in r.json()["type"]


async def _lapsed_pending(store: PostgresStore, op: str, name: str) -> RecordKey:
    key = RecordKey("tenant-a", op, name)
    claim = await store.claim_lease(key, FINGERPRINT, retention_seconds=60, lease_seconds=0.05)
    assert isinstance(claim, Claimed)
    return key


async def test_reconcile_leaves_lapsed_leases_of_takeover_routes_without_reconciler_pending(
    pg_store: PostgresStore,
) -> None:
    """reconcile_batch.py `_expire_leases` (R2, R3, R4): a lapsed lease of a `takeover` route
    without a reconciler stays pending for the client's takeover (R2); one of an operation the
    caller did not read (`known`) stays pending, counted in `left_pending` (R3); one of a
    `takeover` route that has a reconciler is turned unknown and reconciled (R4)."""
    takeover = await _lapsed_pending(pg_store, "POST /takeover", "t")
    unseen = await _lapsed_pending(pg_store, "POST /unseen", "u")
    reconciled = await _lapsed_pending(pg_store, "POST /reconciled", "r")
    await asyncio.sleep(0.15)

    async def happened(ctx: Any) -> Happened:
        return Happened(201, b"{}", [(b"content-type", b"application/json")])

    report = await reconcile_unknown(
        pg_store,
        {"POST /reconciled": happened},
        takeover=["POST /takeover", "POST /reconciled"],
        known=["POST /takeover", "POST /reconciled"],
    )
    states = {k.operation: (await pg_store.get(k)).state for k in (takeover, unseen, reconciled)}  # type: ignore[union-attr]
    assert states == {
        "POST /takeover": State.PENDING,
        "POST /unseen": State.PENDING,
        "POST /reconciled": State.SUCCEEDED,
    }
    assert report.left_pending == {"POST /unseen": 1}
    assert report.expired_leases == 1


async def test_a_claim_and_a_read_see_only_their_own_tenants_record(
    pg_store: PostgresStore,
) -> None:
    """queries.sql `claim_plain`/`claim` (the existing record's SELECT), `get` and `describe`:
    `tenant = $1` (S33, S34, S41). Two tenants use the same key on one operation: each one's
    duplicate is answered from its own record, never the other tenant's response."""
    bodies = {"tenant-a": b'{"owner": "a"}', "tenant-b": b'{"owner": "b"}'}
    for tenant, body in bodies.items():
        key = RecordKey(tenant, OP, "order-1")
        claim = await pg_store.claim_lease(
            key, tenant.encode().ljust(32, b"\x00"), retention_seconds=60, lease_seconds=30
        )
        assert isinstance(claim, Claimed), claim
        assert await pg_store.settle(
            key,
            claim.generation,
            State.PENDING,
            Settlement(State.SUCCEEDED, StoredResponse(201, [], body)),
        )
    for tenant, body in bodies.items():
        key = RecordKey(tenant, OP, "order-1")
        again = await pg_store.claim_lease(
            key, tenant.encode().ljust(32, b"\x00"), retention_seconds=60, lease_seconds=30
        )
        assert isinstance(again, Existing), again
        assert again.record.response is not None
        assert again.record.response.body == body
        record = await pg_store.get(key)
        assert record is not None
        assert record.response is not None
        assert record.response.body == body
        summary = await pg_store.describe(key)
        assert summary is not None
        assert summary.key.tenant == tenant
    # A tenant with no record under the key sees none (the other's is not found for it).
    assert await pg_store.get(RecordKey("tenant-c", OP, "order-1")) is None
    assert await pg_store.describe(RecordKey("tenant-c", OP, "order-1")) is None


async def test_an_operator_move_read_as_unknown_is_refused_once_the_execution_settled_it(
    pg_store: PostgresStore,
) -> None:
    """queries.sql `amend`: `state = $5` (S40). A late execution records its outcome over
    `unknown` under the same generation (fence.py `over_unknown`); an operator who read the
    record as unknown and releases it for a retry must be refused, not run it again."""
    key = RecordKey("tenant-a", OP, "late-1")
    claim = await pg_store.claim_lease(key, FINGERPRINT, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    g = claim.generation
    assert await pg_store.settle(key, g, State.PENDING, Settlement(State.UNKNOWN))
    # (the operator reads it: unknown under g) ... the execution's outcome lands over unknown:
    assert await pg_store.settle(key, g, State.UNKNOWN, Settlement(State.SUCCEEDED, DONE))
    moved = await pg_store.amend(
        key, g, State.UNKNOWN, Settlement(State.PENDING, note="resolve unknown -> pending: no")
    )
    assert moved is False
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.SUCCEEDED


async def test_asking_again_for_an_intent_whose_request_lost_its_lease_is_a_conflict(
    pg_store: PostgresStore,
) -> None:
    """tokens.py `_still_runs`: `not (record.lease_expired or record.retry_allowed)` (C2). The
    request that consumed the intent's token lost its lease (its process died): nothing runs it,
    so asking again is answered at once (TokenConflict: used), not waited on for ~5 s and then
    refused as if it still ran (StoreError)."""

    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id="pay-4", ttl_seconds=0.3)).token
    key = RecordKey("tenant-a", OP, token)
    claim = await pg_store.claim_lease(
        key, FINGERPRINT, retention_seconds=60, lease_seconds=0.05, token_hash=token_hash(token)
    )
    assert isinstance(claim, Claimed)
    await asyncio.sleep(0.4)  # its lease lapsed, and the token expired (used: not renewed)
    started = time.monotonic()
    with pytest.raises(TokenConflict):
        await issuer.issue("tenant-a", OP, intent_id="pay-4", ttl_seconds=300)
    assert time.monotonic() - started < 2


async def test_the_outbox_listing_and_counts_keep_sent_parked_and_unsent_apart(
    pool: Any,
) -> None:
    """queries.sql `outbox_list` (`sent_at IS NULL`, S48) and `outbox_stats` (`unsent` leaves
    parked events out, S49): a delivered event is not listed as waiting, a parked one is not
    counted as still being tried."""

    async def ok(event: OutboxEvent) -> bool:
        return True

    async def failing(event: OutboxEvent) -> bool:
        return False

    async with pool.acquire() as conn, conn.transaction():
        sent_id = await add(conn, "payout.created", {"id": 1}, tenant="tenant-a")
    assert (await Publisher(pool, ok).publish_batch()).sent == 1
    async with pool.acquire() as conn, conn.transaction():
        parked_id = await add(conn, "payout.created", {"id": 2}, tenant="tenant-a")
    assert (await Publisher(pool, failing, max_attempts=1).publish_batch()).parked == 1
    listed = [e["event_id"] for e in await list_events(pool)]
    assert listed == [parked_id]
    assert sent_id not in listed
    stats = await outbox_stats(pool)
    assert (stats["unsent"], stats["parked"], stats["sent"]) == (0, 1, 1), stats


async def test_a_finished_record_is_never_taken_over(pg_store: PostgresStore) -> None:
    """store.py `takeover`: only pending or unknown records (ST1). The `takeover` statement
    itself would take a finished lease-mode record over under its generation: the store refuses
    the call, and the outcome is still replayed."""
    key = RecordKey("tenant-a", OP, "done-1")
    claim = await pg_store.claim_lease(key, FINGERPRINT, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await pg_store.settle(
        key, claim.generation, State.PENDING, Settlement(State.SUCCEEDED, DONE)
    )
    with pytest.raises(ValueError, match="only a pending or unknown record"):
        await pg_store.takeover(key, claim.generation, State.SUCCEEDED, 30)
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.generation == claim.generation
