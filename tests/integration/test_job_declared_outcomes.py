"""A job that returns after `job.declare(...)` is settled as it declared, in either mode and on
either store (docs/jobs.md): FAILED_FINAL stores its result as a final failure (a repeat returns
it, the function not run again); RELEASE stores nothing (the key is free, a repeat runs it)."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import IdempotencyContext, Mode, Outcome
from idem_middleware.jobs import idempotent_job
from idem_middleware.store.base import RecordKey, State, Store


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_job_declaring_failed_final_is_stored_as_a_final_failure(
    store: Store, mode: Mode
) -> None:
    runs = 0

    @idempotent_job(store, operation="declares.final", key="ref", tenant="acme", mode=mode)
    async def job(ctx: IdempotencyContext, *, ref: str) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        ctx.declare(Outcome.FAILED_FINAL)
        return {"declined": ref}

    assert await job(ref="d-1") == {"declined": "d-1"}
    record = await store.get(RecordKey("acme", "declares.final", "d-1"))
    assert record is not None
    assert record.state is State.FAILED_FINAL
    assert await job(ref="d-1") == {"declined": "d-1"}
    assert runs == 1


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_job_declaring_release_stores_nothing_and_runs_again(
    store: Store, mode: Mode
) -> None:
    runs = 0

    @idempotent_job(store, operation="declares.release", key="ref", tenant="acme", mode=mode)
    async def job(ctx: IdempotencyContext, *, ref: str) -> int:
        nonlocal runs
        runs += 1
        ctx.declare(Outcome.RELEASE)
        return runs

    assert await job(ref="r-1") == 1
    assert await store.get(RecordKey("acme", "declares.release", "r-1")) is None
    assert await job(ref="r-1") == 2
    assert runs == 2
