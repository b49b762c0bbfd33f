"""The reconcile rotation's edges (migration 0012), in both stores: the stamp never waits for a
row another session holds and is never put on a record settled under the generation asked about;
a stamp counts in the listing of unknown records alone; a record found held, or whose move the
database refused, goes to the back of the line too; and a stamp the database refuses is logged
and passed over, while a store that fails stops the run."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from idem_middleware import MemoryStore
from idem_middleware.errors import StatementRefused, StoreError
from idem_middleware.ops import reconcile_unknown
from idem_middleware.reconcile import Happened, NotHappened, ReconcileContext, StillUnknown
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, State, Store

OP = "POST /payouts"


async def _unknown(store: Store, *keys: RecordKey) -> dict[RecordKey, int]:
    """Lease-mode records of `keys` gone unknown in that order: their generations."""
    generations = {}
    for key in keys:
        claim = await store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=0.01)
        assert isinstance(claim, Claimed)
        generations[key] = claim.generation
    await asyncio.sleep(0.05)
    for key in keys:
        assert await store.expire_lease(key, generations[key])
        await asyncio.sleep(0.002)
    return generations


def _k(name: str, tenant: str = "tenant-a") -> RecordKey:
    return RecordKey(tenant, OP, name)


async def test_a_row_a_fenced_session_holds_is_not_stamped_nor_waited_for(store: Store) -> None:
    [(key, generation)] = (await _unknown(store, _k("a"))).items()
    async with store.fenced(key, generation, State.UNKNOWN):
        assert not await asyncio.wait_for(store.mark_asked(key, generation), 5)
    assert await store.mark_asked(key, generation)


async def test_a_record_settled_under_its_generation_is_not_stamped(store: Store) -> None:
    generations = await _unknown(store, _k("a"))

    async def settle(ctx: ReconcileContext) -> Any:
        return Happened.json(201, {})

    report = await reconcile_unknown(store, {OP: settle}, seconds=5)
    assert report.verdicts == {"settled": 1}
    summary = await store.describe(_k("a"))
    assert summary is not None
    assert (summary.state, summary.generation) == (State.SUCCEEDED, generations[_k("a")])
    assert not await store.mark_asked(_k("a"), generations[_k("a")])


async def test_a_stamp_orders_unknown_records_alone(store: Store) -> None:
    """`a` was asked about and left unknown, then settled (same generation) before `b`: among
    succeeded records the listing is by `updated_at` still, `a` first."""
    a, b = _k("a", "tenant-a"), _k("b", "tenant-b")
    generations = await _unknown(store, a, b)
    assert await store.mark_asked(a, generations[a])

    async def settle(ctx: ReconcileContext) -> Any:
        return Happened.json(201, {})

    for tenant in ("tenant-a", "tenant-b"):
        await reconcile_unknown(store, {OP: settle}, tenant=tenant, seconds=5)
        await asyncio.sleep(0.002)
    listed = await store.list_records(states=[State.SUCCEEDED])
    assert [r.key for r in listed] == [a, b]


class _Spy(MemoryStore):
    """A memory store whose `allow_retry` (a NotHappened verdict's move) hangs or is refused,
    and whose `mark_asked` may fail."""

    def __init__(self, retry: str = "", stamp: BaseException | None = None) -> None:
        super().__init__()
        self.retry, self.stamp, self.asked = retry, stamp, list[str]()

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        if self.retry == "hang":
            await asyncio.sleep(30)
        if self.retry == "refuse":
            raise StatementRefused("a trigger said no")
        return await super().allow_retry(key, generation, note)

    async def mark_asked(self, key: RecordKey, generation: int) -> bool:
        self.asked.append(key.key)
        if self.stamp is not None:
            raise self.stamp
        return await super().mark_asked(key, generation)


async def _not_happened(ctx: ReconcileContext) -> Any:
    return NotHappened()


async def _still(ctx: ReconcileContext) -> Any:
    return StillUnknown()


@pytest.mark.parametrize("retry", ["hang", "refuse"])
async def test_a_record_held_or_refused_goes_to_the_back_of_the_line(retry: str) -> None:
    store = _Spy(retry=retry)
    await _unknown(store, _k("a"), _k("b"))
    report = await reconcile_unknown(store, {OP: _not_happened}, limit=1, seconds=0.2)
    assert (report.held, report.refused) == ((1, 0) if retry == "hang" else (0, 1))
    assert report.verdicts == {}
    assert store.asked == ["a"]
    listed = await store.list_records(states=[State.UNKNOWN])
    assert [r.key.key for r in listed] == ["b", "a"]


async def test_a_refused_stamp_is_logged_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _Spy(stamp=StatementRefused("a trigger said no"))
    await _unknown(store, _k("a"), _k("b"))
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    report = await reconcile_unknown(store, {OP: _still}, limit=2, seconds=5)
    assert report.verdicts == {"still-unknown": 2}
    assert store.asked == ["a", "b"]
    said = [r for r in caplog.records if "refused to stamp" in r.getMessage()]
    assert [getattr(r, "tenant", None) for r in said] == ["tenant-a", "tenant-a"]
    assert all(r.levelno == logging.WARNING for r in said)


async def test_a_store_failing_to_stamp_stops_the_run() -> None:
    store = _Spy(stamp=StoreError("the database went away"))
    await _unknown(store, _k("a"), _k("b"))
    with pytest.raises(StoreError, match="went away"):
        await reconcile_unknown(store, {OP: _still}, limit=2, seconds=5)
    assert store.asked == ["a"]


async def test_records_gone_unknown_at_one_time_are_listed_by_key(pool: Any, pg_store: Any) -> None:
    """Ties on `updated_at` (one statement's `now()`, one clock reading) are ordered by the key,
    the same in both stores: runs that list them again see them in one order."""
    names = ("c", "a", "b")
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
        " retention, updated_at) SELECT 'tenant-a', $1, k, '\\x00', 'unknown', 'lease',"
        " interval '1 day', now() FROM unnest($2::text[]) AS k",
        OP,
        list(names),
    )
    now = [0.0]
    memory = MemoryStore(clock=lambda: now[0])
    generations = {}
    for name in names:
        claim = await memory.claim_lease(_k(name), b"f" * 32, retention_seconds=60, lease_seconds=1)
        assert isinstance(claim, Claimed)
        generations[name] = claim.generation
    now[0] = 5.0
    for name in names:
        assert await memory.expire_lease(_k(name), generations[name])
    for store in (pg_store, memory):
        listed = await store.list_records(states=[State.UNKNOWN])
        assert [r.key.key for r in listed] == ["a", "b", "c"], store


async def test_a_record_unknown_again_under_a_new_generation_is_not_stamped_for_the_old(
    store: Store,
) -> None:
    [(key, old)] = (await _unknown(store, _k("a"))).items()
    new = await store.takeover(key, old, State.UNKNOWN, 0.01)
    assert new is not None
    await asyncio.sleep(0.05)
    assert await store.expire_lease(key, new)
    assert not await store.mark_asked(key, old)  # (a run that listed it before: stale)
    assert await store.mark_asked(key, new)


async def test_only_a_record_left_unknown_is_stamped() -> None:
    """A settled record is not stamped (no statement for it: its move already put it out of
    the rotation)."""
    store = _Spy()
    await _unknown(store, _k("a"), _k("b"))

    async def answer(ctx: ReconcileContext) -> Any:
        return Happened.json(201, {}) if ctx.key == "a" else StillUnknown()

    report = await reconcile_unknown(store, {OP: answer}, limit=2, seconds=5)
    assert report.verdicts == {"settled": 1, "still-unknown": 1}
    assert store.asked == ["b"]
