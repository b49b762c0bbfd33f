"""Idempotent jobs that crash, change mode between runs, or get values no store can keep, on
both stores (MemoryStore and real PostgreSQL)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import anyio
import pytest

from idem_middleware import IdempotencyContext, MemoryStore, Mode
from idem_middleware.errors import ConfigurationError
from idem_middleware.jobs import JobInProgress, JobOutcomeUnknown, _fingerprint, idempotent_job
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, Store
from idem_middleware.store.postgres import PostgresStore
from idem_middleware.tenant import MAX_TENANT_BYTES
from tests.apps import BOUND

OPERATION = "payouts.send"
KEY = RecordKey("", OPERATION, "p-1")


def job(
    store: Store,
    mode: Mode,
    runs: list[int],
    started: asyncio.Event | None = None,
    wait_seconds: float = 5.0,
) -> Any:
    @idempotent_job(
        store, operation=OPERATION, key="payout_id", mode=mode, wait_seconds=wait_seconds
    )
    async def send(ctx: IdempotencyContext, *, payout_id: str) -> dict[str, int]:
        runs.append(ctx.generation)
        if started is not None:
            started.set()
            await asyncio.Event().wait()  # until cancelled
        return {"generation": ctx.generation}

    return send


async def state_of(store: Store) -> State | None:
    record = await store.get(KEY)
    return None if record is None else record.state


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_job_cancelled_mid_run_is_never_wedged(store: Store, mode: Mode) -> None:
    """Cancelled while it runs (a worker shutting down): transactional, everything rolls back
    and the next delivery runs it; lease mode, its effect may have happened: `unknown`."""
    runs: list[int] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(job(store, mode, runs, started)(payout_id="p-1"))
    await asyncio.wait_for(started.wait(), BOUND)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND)
    again = job(store, mode, runs)
    if mode is Mode.TRANSACTIONAL:
        assert await state_of(store) is None
        assert (await again(payout_id="p-1"))["generation"] == runs[-1]
        assert await state_of(store) is State.SUCCEEDED
        assert len(runs) == 2
    else:
        assert await state_of(store) is State.UNKNOWN
        with pytest.raises(JobOutcomeUnknown):
            await again(payout_id="p-1")
        assert len(runs) == 1


async def test_a_lease_job_cancelled_by_an_anyio_task_group_is_unknown(store: Store) -> None:
    """The same, run in an anyio task group (a worker built on anyio, Starlette's
    BaseHTTPMiddleware) whose scope is cancelled: its cancel scope cancels every await until the
    task ends, and it cut the `unknown` settlement short, silently; the record stayed `pending`
    under its live lease, and every delivery was told the job is in progress until it lapsed."""
    runs: list[int] = []
    started = asyncio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: job(store, Mode.LEASE, runs, started)(payout_id="p-1"))
        await asyncio.wait_for(started.wait(), BOUND)
        group.cancel_scope.cancel()
    assert await state_of(store) is State.UNKNOWN
    with pytest.raises(JobOutcomeUnknown):
        await job(store, Mode.LEASE, runs)(payout_id="p-1")
    assert len(runs) == 1


async def died_in_lease_mode(store: Store) -> int:
    """A lease-mode run's claim, as a worker that died mid-run left it (its lease still live)."""
    fingerprint = _fingerprint(OPERATION, (), {"payout_id": "p-1"})
    claimed = await store.claim_lease(
        KEY, fingerprint, retention_seconds=3600.0, lease_seconds=30.0
    )
    assert isinstance(claimed, Claimed)
    return claimed.generation


async def lapse(store: Store) -> None:
    if isinstance(store, PostgresStore):
        await store.pool.execute(
            "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
        )
    else:
        assert isinstance(store, MemoryStore)
        row = store._rows[KEY]
        store._rows[KEY] = replace(row, lease_expires_at=store.clock() - 1.0)


async def test_a_lease_run_that_died_is_unknown_to_the_job_made_transactional(
    store: Store,
) -> None:
    """Found by probing: a job moved from lease mode to transactional mode (a deploy between
    two deliveries) whose lease-mode run had died raised JobInProgress ("another run holds this
    key") on every delivery, until an operator ran `reconcile`. It now raises
    JobOutcomeUnknown, and the record is `unknown`, as a lease-mode repeat would have made it."""
    await died_in_lease_mode(store)
    runs: list[int] = []
    with pytest.raises(JobInProgress):  # its lease is live: in flight (waited for), never run
        await job(store, Mode.TRANSACTIONAL, runs, wait_seconds=0.2)(payout_id="p-1")
    await lapse(store)
    with pytest.raises(JobOutcomeUnknown):
        await job(store, Mode.TRANSACTIONAL, runs)(payout_id="p-1")
    assert await state_of(store) is State.UNKNOWN
    assert runs == []


async def test_a_released_lease_run_is_run_by_the_job_made_transactional(store: Store) -> None:
    """Found by probing: a lease-mode run an operator released for a retry (it did not happen)
    raised JobInProgress for good once the job was transactional. It now runs, once."""
    generation = await died_in_lease_mode(store)
    assert await store.settle(KEY, generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.allow_retry(KEY, generation, "not at the bank")
    runs: list[int] = []
    send = job(store, Mode.TRANSACTIONAL, runs)
    first = await send(payout_id="p-1")
    assert await send(payout_id="p-1") == first
    assert len(runs) == 1
    assert await state_of(store) is State.SUCCEEDED


@pytest.mark.parametrize("operation", ["a\x00b", "\ud800"], ids=["nul", "lone-surrogate"])
def test_an_operation_no_store_can_keep_is_refused_when_decorated(operation: str) -> None:
    """Found by probing: a NUL reached PostgreSQL as a raw driver error at the first call (the
    twin took it), an unpaired surrogate a UnicodeEncodeError from the fingerprint."""
    with pytest.raises(ConfigurationError, match="operation"):
        idempotent_job(MemoryStore(), operation=operation, key="k")


async def test_a_key_or_tenant_with_an_unpaired_surrogate_is_refused_before_the_claim(
    store: Store,
) -> None:
    """Found by probing: on PostgreSQL the driver's own error (DataError, UnicodeEncodeError),
    and on the twin a record under a key the database could never hold."""
    runs: list[int] = []

    @idempotent_job(
        store,
        operation="send",
        key=lambda **kw: kw["k"] + "\ud800"[: kw["bad_key"]],
        tenant=lambda **kw: "acme" + "\udc00"[: kw["bad_tenant"]],
    )
    async def send(ctx: IdempotencyContext, *, k: str, bad_key: int, bad_tenant: int) -> int:
        runs.append(1)
        return 1

    for bad_key, bad_tenant in ((1, 0), (0, 1)):
        with pytest.raises(ValueError, match="unpaired surrogate"):
            await send(k="k1", bad_key=bad_key, bad_tenant=bad_tenant)
    assert runs == []
    assert await send(k="k1", bad_key=0, bad_tenant=0) == 1


async def test_a_tenant_longer_than_a_record_key_holds_is_refused_before_the_claim(
    store: Store,
) -> None:
    """As a request's tenant is (MAX_TENANT_BYTES): on PostgreSQL a longer one failed at the claim
    with the driver's index-row error, and the twin took it."""
    runs: list[str] = []

    @idempotent_job(store, operation="send", key=lambda **kw: "k1", tenant=lambda **kw: kw["t"])
    async def send(ctx: IdempotencyContext, *, t: str) -> int:
        runs.append(t)
        return 1

    with pytest.raises(ValueError, match=f"over {MAX_TENANT_BYTES} bytes"):
        await send(t="é" * (MAX_TENANT_BYTES // 2 + 1))
    assert runs == []
    assert await send(t="é" * (MAX_TENANT_BYTES // 2)) == 1
