"""Lease-mode executor behaviours no test pinned before (a run of hand-made mutations of
lease_executor.py survived each): the first renewal falls due a third of the lease after the
claim, before the lease can lapse; a handler cancelled after its record was taken over ends
cancelled, not answered. Each docstring names the line it pins. (In-memory store: what is pinned
is the executor's, not a statement's.)"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.store.base import RecordKey, State

KEY = RecordKey("t", "POST /pay", "k1")
BOUND = 10.0


class RenewalsSeen(MemoryStore):
    """Says when the first renewal reached the store (on the loop's clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed = asyncio.Event()
        self.first_at: float | None = None

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        if self.first_at is None:
            self.first_at = asyncio.get_running_loop().time()
            self.renewed.set()
        return await super().heartbeat(key, generation, lease_seconds)


class PausedRenewals(MemoryStore):
    """An executor whose renewals never reach the store (a paused process): its lease lapses."""

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        return True


def _lease_app(
    store: MemoryStore, pay: Any, lease_seconds: float, observers: list[Any] | None = None
) -> IdempotencyMiddleware:
    """`pay` at POST /pay, in lease mode, for tenant "t"."""
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    return IdempotencyMiddleware(
        app,
        store=store,
        default_policy=Policy(mode=Mode.LEASE, lease_seconds=lease_seconds),
        tenant_resolver=lambda scope: "t",
        observers=observers or [],
    )


def _app(store: MemoryStore, lease_seconds: float, entered: asyncio.Event) -> IdempotencyMiddleware:
    gate = asyncio.Event()  # never set: the handler runs until cancelled (or the test ends)

    async def pay(request: Request) -> Response:
        entered.set()
        await asyncio.wait_for(gate.wait(), BOUND)
        return JSONResponse({}, status_code=201)

    return _lease_app(store, pay, lease_seconds)


def _post(mw: IdempotencyMiddleware) -> asyncio.Task[httpx.Response]:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=mw)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/pay", json={}, headers={"idempotency-key": "k1"})

    return asyncio.ensure_future(post())


async def test_the_first_renewal_falls_due_a_third_of_the_lease_after_the_claim() -> None:
    """lease_executor.py `_renewals`: `Delayed(lease_seconds / 3)`. Renewed only as the
    lease ends (a delay of a whole lease), a duplicate arriving then finds it lapsed and takes
    the record over while the handler still runs: its effect twice."""
    lease = 3.0
    store = RenewalsSeen()
    entered = asyncio.Event()
    task = _post(_app(store, lease, entered))
    try:
        await asyncio.wait_for(entered.wait(), BOUND)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(store.renewed.wait(), BOUND)
        assert store.first_at is not None
        # Due at a third (1 s); well before the lease could lapse (3 s after the claim).
        assert store.first_at - started < lease * 2 / 3
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=BOUND)


async def test_a_handler_cancelled_after_a_takeover_ends_cancelled() -> None:
    """lease_executor.py `run`: `if moved or not isinstance(exc, Exception): raise`. The
    record was taken over while the handler ran (its lease lapsed), so no `unknown` mark moves
    it; the cancellation (a server's shutdown, an `asyncio.timeout` around the app) still goes
    on. Swallowed, the cancelled request was answered 409 and returned as if never cancelled."""
    store = PausedRenewals()
    entered = asyncio.Event()
    task = _post(_app(store, 0.2, entered))
    try:
        await asyncio.wait_for(entered.wait(), BOUND)
        record = await store.get(KEY)
        assert record is not None
        for _ in range(1_000):  # bounded: 10 s
            record = await store.get(KEY)
            assert record is not None
            if record.lease_expired:
                break
            await asyncio.sleep(0.01)
        assert record.lease_expired
        taken = await store.takeover(KEY, record.generation, State.PENDING, 30)
        assert taken is not None
        assert taken > record.generation
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=BOUND)
        assert task in done
        assert task.cancelled(), f"answered instead: {task.result()!r}"
        after = await store.get(KEY)
        assert after is not None
        assert (after.state, after.generation) == (State.PENDING, taken)  # the new owner's
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=BOUND)


class Unreachable(MemoryStore):
    """Renewals that never reach the store (the database down); everything else works."""

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        from idem_middleware.errors import StoreError

        raise StoreError("ConnectionRefusedError: the server is down")


async def test_an_execution_whose_renewals_fail_stops_holding_the_record_as_its_lease_ends() -> (
    None
):
    """lease_executor.py `_heartbeat`: `held_until = self.due_at + lease * 2 / 3`: the
    lease granted ends a lease after the execution started. Counted from later, the execution
    went on believing it held the record (`lease_lost` clear) while another process may
    already have taken it over."""
    from idem_middleware import get_context

    lease = 1.5
    lost_after: list[float] = []

    async def pay(request: Request) -> Response:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(get_context(request).lease_lost.wait(), BOUND)
        lost_after.append(loop.time() - started)
        return JSONResponse({}, status_code=201)

    mw = _lease_app(Unreachable(), pay, lease)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as c:
        await asyncio.wait_for(c.post("/pay", json={}, headers={"idempotency-key": "k1"}), BOUND)
    assert len(lost_after) == 1
    # Lost as the lease ends (1.5 s), not a lease and two thirds in (2.5 s).
    assert lost_after[0] < lease * 4 / 3


class SettledUnderARenewal(MemoryStore):
    """The outcome is recorded, and its statement answers only after a renewal has found the
    record settled (a renewal that met the settlement)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0
        self.renewed = asyncio.Event()
        self.refused_renewal = asyncio.Event()
        self.settled = False

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        alive = await super().heartbeat(key, generation, lease_seconds)
        self.renewals += 1
        self.renewed.set()
        if self.settled and not alive:
            self.refused_renewal.set()
        return alive

    async def settle(self, key: RecordKey, generation: int, expected: State, s: object) -> bool:
        done = await super().settle(key, generation, expected, s)  # type: ignore[arg-type]
        if done and getattr(s, "state", None) is State.SUCCEEDED:
            self.settled = True
            await asyncio.wait_for(self.refused_renewal.wait(), BOUND)
        return done


async def test_a_renewal_that_meets_the_executions_own_settlement_is_no_lost_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """lease_executor.py `_heartbeat`: `settling=lambda: fence.settling`. A renewal that
    finds the record settled while the settlement is in flight met that very settlement: no
    "lease lost" warning for a request that succeeded (an operator paged for nothing), and
    `lease_lost` stays clear."""
    import logging

    from idem_middleware import get_context

    store = SettledUnderARenewal()
    contexts: list[object] = []

    async def pay(request: Request) -> Response:
        contexts.append(get_context(request))
        await asyncio.wait_for(store.renewed.wait(), BOUND)  # the renewals have started
        return JSONResponse({}, status_code=201)

    mw = _lease_app(store, pay, 0.3)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=mw), base_url="http://t"
        ) as c:
            answer = await asyncio.wait_for(
                c.post("/pay", json={}, headers={"idempotency-key": "k1"}), BOUND
            )
    assert answer.status_code == 201
    assert store.refused_renewal.is_set()
    assert not [r for r in caplog.records if r.getMessage().startswith("lease lost")]
    assert not contexts[0].lease_lost.is_set()  # type: ignore[attr-defined]


class Blip(MemoryStore):
    """The outcome's first settlement fails on a blip; the next one is recorded or, with
    `then_refused`, refused by the database (a trigger, a constraint: sending it again cannot
    help; marking the record `unknown` works)."""

    def __init__(self, then_refused: bool) -> None:
        super().__init__()
        self.then_refused = then_refused
        self.tries = 0

    async def settle(self, key: RecordKey, generation: int, expected: State, s: object) -> bool:
        from idem_middleware.errors import StatementRefused, StoreError

        if getattr(s, "state", None) is State.SUCCEEDED:
            self.tries += 1
            if self.tries == 1:
                raise StoreError("ConnectionDoesNotExistError: connection was closed")
            if self.then_refused:
                raise StatementRefused("CheckViolationError: refused by a trigger")
        return await super().settle(key, generation, expected, s)  # type: ignore[arg-type]


async def test_a_settlement_sent_again_and_refused_leaves_the_record_unknown() -> None:
    """resettle.py `settle_again`: `await execution._unresolved(context, seconds=0.0)`.
    The handler ran and its outcome could not be recorded: the record is marked `unknown` (a
    reconciler or an operator decides), not left `pending`, every retry told "in flight" until
    the lease lapses and then (a takeover route) the handler run again."""
    store = Blip(then_refused=True)

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    mw = _lease_app(store, pay, 30)
    transport = httpx.ASGITransport(app=mw, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        answer = await asyncio.wait_for(
            c.post("/pay", json={}, headers={"idempotency-key": "k1"}), BOUND
        )
    assert answer.status_code >= 500
    assert store.tries == 2
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN


async def test_a_settlement_recorded_on_a_later_try_is_counted_once() -> None:
    """resettle.py `_resend`: `execution.ex.emit(SETTLED_EVENTS[outcome], generation)`.
    A settlement recorded after a blip is counted by its outcome (`succeeded`), as one recorded
    at once is: not left counted `claimed` only, with no outcome at all."""
    from contextlib import nullcontext

    from idem_middleware.observe import Event

    class Recorder:
        def __init__(self) -> None:
            self.events: list[Event] = []

        def event(self, event: Event, attributes: object) -> None:
            self.events.append(event)

        def timed(self, name: str, attributes: object) -> nullcontext[None]:
            return nullcontext()

    store = Blip(then_refused=False)
    recorder = Recorder()

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    mw = _lease_app(store, pay, 30, observers=[recorder])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as c:
        answer = await asyncio.wait_for(
            c.post("/pay", json={}, headers={"idempotency-key": "k1"}), BOUND
        )
    assert answer.status_code == 201
    assert store.tries == 2
    assert recorder.events == [Event.CLAIMED, Event.SUCCEEDED]
