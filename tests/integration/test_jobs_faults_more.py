"""Idempotent jobs (and a lease-mode route) meeting what is not theirs: another run's lost claim
raised through them, arguments JSON cannot tell apart or the function cannot take, a pool
with no connection to give. On both stores where a database is not the point."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext, Mode, Policy
from idem_middleware.errors import ConfigurationError, StaleGeneration, StoreError
from idem_middleware.jobs import JobOutcomeUnknown, idempotent_job
from idem_middleware.policy import LeaseExpiry
from idem_middleware.store.base import RecordKey, Settlement, State, Store
from idem_middleware.store.postgres import PostgresStore
from tests.apps import BOUND, assert_problem, client, one_route_app


async def state_of(store: Store, key: RecordKey) -> State | None:
    record = await store.get(key)
    return None if record is None else record.state


def inner_that_loses_its_claim(store: Store) -> Callable[..., Awaitable[Any]]:
    """A lease-mode job whose claim is lost while it runs (marked `unknown`, then released for a
    retry under a new generation, as a takeover after a lapse would): it raises
    StaleGeneration, its own, to whoever called it."""

    @idempotent_job(store, operation="inner", key="k", mode=Mode.LEASE)
    async def inner(job: IdempotencyContext, *, k: str) -> str:
        key = RecordKey("", "inner", k)
        assert await store.settle(key, job.generation, State.PENDING, Settlement(State.UNKNOWN))
        assert await store.allow_retry(key, job.generation, "an operator")
        return "inner done"

    return inner


@pytest.mark.parametrize("raised", ["nested job", "raised by the function"])
async def test_a_stale_generation_not_the_jobs_own_is_its_error_like_any(
    store: Store, raised: str
) -> None:
    """A lease-mode job whose function lets another run's StaleGeneration escape (a nested
    lease-mode job that lost its claim) did its effect: its record is `unknown`, as for any
    error it raises, not left `pending` for a takeover to run the effect a second time."""
    inner = inner_that_loses_its_claim(store)
    effects: list[str] = []

    @idempotent_job(
        store,
        operation="outer",
        key="k",
        mode=Mode.LEASE,
        on_lease_expiry=LeaseExpiry.TAKEOVER,
        wait_seconds=0,
    )
    async def outer(job: IdempotencyContext, *, k: str) -> str:
        effects.append("payment sent")
        if raised == "nested job":
            result: str = await inner(k=k)
            return result
        raise StaleGeneration("not this run's")

    with pytest.raises(StaleGeneration):
        await asyncio.wait_for(outer(k="m1"), BOUND)
    assert await state_of(store, RecordKey("", "outer", "m1")) is State.UNKNOWN
    with pytest.raises(JobOutcomeUnknown):
        await asyncio.wait_for(outer(k="m1"), BOUND)
    assert effects == ["payment sent"]


async def test_a_jobs_own_lost_claim_still_records_nothing(store: Store) -> None:
    """The job's own StaleGeneration (its fenced connection refused: another generation holds
    the record) is still its lost claim: it raises, and the newer generation's record (released
    for a retry) stands."""

    generations: list[int] = []

    @idempotent_job(store, operation="own", key="k", mode=Mode.LEASE)
    async def own(job: IdempotencyContext, *, k: str) -> str:
        generations.append(job.generation)
        key = RecordKey("", "own", k)
        assert await store.settle(key, job.generation, State.PENDING, Settlement(State.UNKNOWN))
        assert await store.allow_retry(key, job.generation, "an operator")
        await job.fenced_connection()  # refused: StaleGeneration
        return "unreachable"

    with pytest.raises(StaleGeneration):
        await asyncio.wait_for(own(k="m1"), BOUND)
    record = await store.get(RecordKey("", "own", "m1"))
    assert record is not None
    assert (record.state, record.retry_allowed) == (State.PENDING, True)
    assert record.generation > generations[0]


@pytest.mark.parametrize("raised", ["nested job", "raised by the handler"])
async def test_a_stale_generation_not_the_routes_own_is_its_error_like_any(
    store: Store, raised: str
) -> None:
    """The same for a lease-mode route: a handler that lets another execution's StaleGeneration
    escape is `unknown` (a 500, then 409 outcome-unknown), not answered as a stale executor
    with its record left `pending`."""
    inner = inner_that_loses_its_claim(store)
    effects: list[str] = []

    async def handler(request: Request) -> Response:
        effects.append("payment sent")
        if raised == "nested job":
            return JSONResponse({"inner": await inner(k="h1")}, status_code=201)
        raise StaleGeneration("not this execution's")

    path = "/payments"
    policy = Policy(mode=Mode.LEASE, on_lease_expiry=LeaseExpiry.TAKEOVER, wait_seconds=0.1)
    app = one_route_app(path, handler, store=store, policies={f"POST {path}": policy})
    async with client(app) as http:
        first = await asyncio.wait_for(
            http.post(path, headers={"Idempotency-Key": "h1"}, json={}), BOUND
        )
        assert first.status_code == 500, first.text
        key = RecordKey("tenant-a", f"POST {path}", "h1")
        assert await state_of(store, key) is State.UNKNOWN
        again = await asyncio.wait_for(
            http.post(path, headers={"Idempotency-Key": "h1"}, json={}), BOUND
        )
        assert_problem(again, 409, "outcome-unknown")
    assert effects == ["payment sent"]


@dataclass
class Order:
    amount: float


@dataclass(slots=True, frozen=True)
class Line:
    sku: str
    amounts: tuple[float, ...]


@pytest.mark.parametrize(
    "value",
    [
        Order(float("inf")),
        Order(float("-inf")),
        Order(float("nan")),
        [Line("a", (1.0, float("inf")))],
        {"order": Order(float("nan"))},
    ],
    ids=["inf", "-inf", "nan", "slots-in-list", "in-dict"],
)
async def test_non_finite_floats_in_a_dataclass_argument_are_refused(
    store: Store, value: Any
) -> None:
    """orjson writes a dataclass natively, its NaN and infinities as null: Order(inf) and
    Order(-inf) were one fingerprint, the second call getting the first's result. Refused
    before the claim, as a float of its own is."""
    runs: list[Any] = []

    @idempotent_job(store, operation="orders.place", key="order_id")
    async def place(job: IdempotencyContext, *, order_id: str, order: Any) -> str:
        runs.append(order)
        return "placed"

    with pytest.raises(ConfigurationError, match="NaN"):
        await place(order_id="o1", order=value)
    assert await store.get(RecordKey("", "orders.place", "o1")) is None
    assert await place(order_id="o1", order=Order(1.5)) == "placed"
    assert await place(order_id="o2", order=Order(None)) == "placed"  # type: ignore[arg-type]
    assert runs == [Order(1.5), Order(None)]  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {"ref": "r1"}),
        ((), {"ref": "r1", "amount": 5, "currency": "EUR"}),
        ((5,), {"ref": "r1"}),
    ],
    ids=["missing", "unexpected", "positional"],
)
async def test_a_call_the_function_cannot_take_claims_nothing(
    store: Store, mode: Mode, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A call with arguments the function cannot take raises its TypeError before the claim:
    in lease mode it committed the claim first and left the key `unknown` for a function that
    never ran, and the corrected call got JobKeyReused."""
    ran: list[int] = []

    @idempotent_job(store, operation="pay", key="ref", mode=mode, wait_seconds=0)
    async def pay(job: IdempotencyContext, *, ref: str, amount: int) -> int:
        ran.append(amount)
        return amount

    with pytest.raises(TypeError, match=r"^pay: "):
        await asyncio.wait_for(pay(*args, **kwargs), BOUND)
    assert await store.get(RecordKey("", "pay", "r1")) is None
    assert await asyncio.wait_for(pay(ref="r1", amount=5), BOUND) == 5
    assert await asyncio.wait_for(pay(ref="r1", amount=5), BOUND) == 5
    assert ran == [5]


async def test_a_wrapper_that_supplies_an_argument_is_called_as_it_accepts(store: Store) -> None:
    """The arguments are checked against the decorated function's own signature, not the one
    it wraps (`functools.wraps`): a wrapper that supplies an argument itself still runs."""

    def with_rate(fn: Callable[..., Awaitable[int]]) -> Callable[..., Awaitable[int]]:
        @functools.wraps(fn)
        async def wrapper(job: IdempotencyContext, **kwargs: Any) -> int:
            return await fn(job, rate=3, **kwargs)

        return wrapper

    @idempotent_job(store, operation="rated", key="ref", mode=Mode.LEASE)
    @with_rate
    async def rated(job: IdempotencyContext, *, ref: str, amount: int, rate: int) -> int:
        return amount * rate

    assert await asyncio.wait_for(rated(ref="r1", amount=2), BOUND) == 6


@pytest.fixture
async def one_connection(
    pool: asyncpg.Pool[Any], db_target: tuple[str, dict[str, Any]]
) -> AsyncIterator[PostgresStore]:
    """A store whose pool has one connection (the store's own bound left at its 10 s)."""
    dsn, _ = db_target
    async with PostgresStore(dsn=dsn, min_size=1, max_size=1, listen=False) as store:
        yield store


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_jobs_acquire_timeout_bounds_its_wait_for_a_connection(
    one_connection: PostgresStore, mode: Mode
) -> None:
    """With every pooled connection held elsewhere, a job waits `acquire_timeout` for one, then
    raises StoreError, nothing claimed: lease mode's checkouts (the store's own) waited the
    store's bound (10 s) instead."""

    @idempotent_job(one_connection, operation="op", key="k", mode=mode, acquire_timeout=0.3)
    async def f(job: IdempotencyContext, *, k: str) -> int:
        return 1

    async with one_connection.pool.acquire():  # the pool's only connection, held elsewhere
        started = time.monotonic()
        with pytest.raises(StoreError):
            await asyncio.wait_for(f(k="k1"), BOUND)
        assert time.monotonic() - started < 2.0
    assert await one_connection.get(RecordKey("", "op", "k1")) is None
    assert await asyncio.wait_for(f(k="k1"), BOUND) == 1
