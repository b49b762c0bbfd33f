"""A lease-mode request (or job) cancelled (the server's graceful timeout) after its handler
returned, while its settlement is in flight: waiting for a pooled connection, say. The handler
ran, so its record is `unknown`, as a cancelled handler's is, not `pending` until its lease
lapses, when a retry on a `LeaseExpiry.TAKEOVER` route took it over and ran the handler again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext, LeaseExpiry, Policy, PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.jobs import JobOutcomeUnknown, idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey, Settlement, State
from tests.apps import one_route_app
from tests.apps.clients import asgi_request, client

BOUND = 30.0
KEY = RecordKey("tenant-a", "POST /charges", "k1")


class HeldSettlement(PostgresStore):
    """A final outcome's compare-and-set waits (as for a pooled connection) until released."""

    entered: asyncio.Event
    release: asyncio.Event

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if s.state is State.SUCCEEDED:
            self.entered.set()
            await self.release.wait()
        return await super().settle(key, generation, expected, s)


def _payout_job(store: PostgresStore, runs: list[str]) -> Any:
    """A lease-mode job that notes its runs, on a TAKEOVER policy with a short lease."""

    @idempotent_job(
        store,
        operation="payout",
        key="ref",
        mode=Mode.LEASE,
        lease_seconds=0.6,
        on_lease_expiry=LeaseExpiry.TAKEOVER,
    )
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        runs.append(ref)
        return {"paid": ref}

    return payout


def counted_charge(runs: list[int]) -> Any:
    """A handler that notes each run and answers 201."""

    async def charge(request: Request) -> Response:
        await request.body()
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=201)

    return charge


async def _cancelled_then_unknown(
    store: PostgresStore, payout: Any, call: asyncio.Task[Any], runs: list[str]
) -> None:
    """Cancel the job's call: its record is `unknown`, and a call past the lease raises
    JobOutcomeUnknown rather than taking it over and running the function again."""
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, BOUND)
    record = await store.get(RecordKey("", "payout", "r1"))
    assert record is not None
    assert record.state is State.UNKNOWN
    await asyncio.sleep(0.8)  # past the lease
    with pytest.raises(JobOutcomeUnknown):
        await asyncio.wait_for(payout(ref="r1"), BOUND)
    assert runs == ["r1"]


def server() -> tuple[Any, Any, list[dict[str, Any]]]:
    """An ASGI server's receive and send: the body, then a client that never leaves."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(BOUND)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return receive, send, sent


@pytest.mark.parametrize("expiry", [LeaseExpiry.TAKEOVER, LeaseExpiry.UNKNOWN])
async def test_a_settlement_cancelled_in_flight_leaves_the_record_unknown(
    db_dsn: str, expiry: LeaseExpiry
) -> None:
    runs: list[int] = []

    store = HeldSettlement(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.entered, store.release = asyncio.Event(), asyncio.Event()
    policy = Policy(mode=Mode.LEASE, lease_seconds=0.6, wait_seconds=0.1, on_lease_expiry=expiry)
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE idem_key = 'k1'")
        charge = counted_charge(runs)
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
        receive, send, sent = server()
        request = asyncio.create_task(app(asgi_request("/charges", "k1", 2), receive, send))
        await asyncio.wait_for(store.entered.wait(), BOUND)
        request.cancel()  # the server's graceful timeout, the settlement in flight
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, BOUND)
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [503]
        record = await store.get(KEY)
        assert record is not None
        assert record.state is State.UNKNOWN  # (was `pending`, until its lease lapsed)
        await asyncio.sleep(policy.lease_seconds + 0.2)  # a lease lapsed changes nothing now
        async with client(app) as http:
            retry = await http.post("/charges", json={}, headers={"Idempotency-Key": "k1"})
        assert retry.status_code == 409
        assert retry.json()["type"].endswith("outcome-unknown")
        assert len(runs) == 1  # never run again
        store.release.set()


async def test_a_lease_jobs_settlement_cancelled_in_flight_leaves_the_record_unknown(
    db_dsn: str,
) -> None:
    """The same for a lease-mode job (a queue consumer's, cancelled at its shutdown): its next
    call, past the lease, raises JobOutcomeUnknown instead of taking the record over."""
    runs: list[str] = []
    store = HeldSettlement(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.entered, store.release = asyncio.Event(), asyncio.Event()
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE operation = 'payout'")

        payout = _payout_job(store, runs)

        call = asyncio.create_task(payout(ref="r1"))
        await asyncio.wait_for(store.entered.wait(), BOUND)
        await _cancelled_then_unknown(store, payout, call, runs)
        store.release.set()


class HeldRenewal(PostgresStore):
    """A renewal waits (as for a slow server) until released; notes how it ended."""

    renewing: asyncio.Event
    release: asyncio.Event
    renewals: list[str]

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.renewing.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.renewals.append("cancelled")
            raise
        self.renewals.append("done")
        return await super().heartbeat(key, generation, lease_seconds)


async def test_a_request_cancelled_while_its_renewal_finishes_leaves_the_renewal_be(
    db_dsn: str,
) -> None:
    """The execution settled and waits for its heartbeat's renewal in flight to finish (never
    cancelled mid-write): the server's cancellation then ends the request at once, and is not
    passed on to the renewal (there, on Python 3.11, a wait could lose it)."""

    async def charge(request: Request) -> Response:
        await request.body()
        await asyncio.wait_for(store.renewing.wait(), BOUND)  # a renewal under way
        return JSONResponse({"ok": 1}, status_code=201)

    store = HeldRenewal(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.renewing, store.release, store.renewals = asyncio.Event(), asyncio.Event(), []
    policy = Policy(mode=Mode.LEASE, lease_seconds=0.3, wait_seconds=0.1)
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE idem_key = 'k1'")
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
        receive, send, _sent = server()
        request = asyncio.create_task(app(asgi_request("/charges", "k1", 2), receive, send))
        for _ in range(int(BOUND / 0.01)):  # settled: it waits for the renewal now
            record = await store.get(KEY)
            if record is not None and record.state is State.SUCCEEDED:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, BOUND)
        store.release.set()
        for _ in range(int(BOUND / 0.01)):
            if store.renewals:
                break
            await asyncio.sleep(0.01)
        assert store.renewals == ["done"]  # (not cut mid-write)


class BlipThenHold(PostgresStore):
    """The first final settlement fails as on a blip (sent again after a pause); an `unknown`
    mark waits until `gate` is set (when `hold_marks`)."""

    failed: asyncio.Event
    marking: asyncio.Event
    gate: asyncio.Event
    hold_marks = False

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if s.state is State.SUCCEEDED and not self.failed.is_set():
            self.failed.set()
            raise StoreError("ConnectionDoesNotExistError: connection was closed")
        if s.state is State.UNKNOWN and self.hold_marks:
            self.marking.set()
            await self.gate.wait()
        return await super().settle(key, generation, expected, s)


def _blip_store(db_dsn: str) -> BlipThenHold:
    store = BlipThenHold(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.failed, store.marking, store.gate = asyncio.Event(), asyncio.Event(), asyncio.Event()
    return store


async def test_a_lease_job_cancelled_while_its_settlement_is_sent_again_is_unknown(
    db_dsn: str,
) -> None:
    """The job's settlement failed on a blip, and the job is cancelled (its consumer shutting
    down) while the settlement waits to be sent again: `unknown`, not `pending` (a TAKEOVER
    call past the lease ran the function again)."""
    runs: list[str] = []
    store = _blip_store(db_dsn)
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE operation = 'payout'")

        payout = _payout_job(store, runs)

        call = asyncio.create_task(payout(ref="r1"))
        await asyncio.wait_for(store.failed.wait(), BOUND)
        await asyncio.sleep(0)  # (it pauses before sending the settlement again)
        await _cancelled_then_unknown(store, payout, call, runs)


async def test_a_second_cancellation_does_not_cut_the_unknown_mark_short(db_dsn: str) -> None:
    """The server cancels a request whose handler ran; while its record is marked `unknown`,
    the task is cancelled again (an outer timeout, `asyncio.run` at its exit): the mark still
    lands (it was cut short, the record left `pending`, and a TAKEOVER retry ran it again)."""
    runs: list[int] = []
    entered = asyncio.Event()

    async def charge(request: Request) -> Response:
        await request.body()
        runs.append(1)
        entered.set()
        await asyncio.sleep(BOUND)  # (cancelled here)
        return JSONResponse({}, status_code=201)

    store = _blip_store(db_dsn)
    store.failed.set()  # (no blip here)
    store.hold_marks = True
    policy = Policy(
        mode=Mode.LEASE, lease_seconds=0.6, wait_seconds=0.1, on_lease_expiry=LeaseExpiry.TAKEOVER
    )
    async with store:
        await store.pool.execute("DELETE FROM idem_requests WHERE idem_key = 'k1'")
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": policy})
        receive, send, _sent = server()
        request = asyncio.create_task(app(asgi_request("/charges", "k1", 2), receive, send))
        await asyncio.wait_for(entered.wait(), BOUND)
        request.cancel()
        await asyncio.wait_for(store.marking.wait(), BOUND)
        request.cancel()  # again, while the record is marked
        await asyncio.sleep(0.05)
        store.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, BOUND)
        record = await store.get(KEY)
        assert record is not None
        assert record.state is State.UNKNOWN
        await asyncio.sleep(0.8)  # past the lease
        async with client(app) as http:
            retry = await http.post("/charges", json={}, headers={"Idempotency-Key": "k1"})
        assert retry.status_code == 409
        assert runs == [1]
