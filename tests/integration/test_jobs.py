"""Idempotent jobs (idem_middleware.jobs) on both stores: MemoryStore and real PostgreSQL."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import asyncpg
import pytest

from idem_middleware import IdempotencyContext, MemoryStore, Mode, Outcome
from idem_middleware.errors import ConfigurationError
from idem_middleware.jobs import JobInProgress, JobKeyReused, JobOutcomeUnknown, idempotent_job
from idem_middleware.jobs_spec import JobSpec
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, State, Store
from idem_middleware.store.postgres import PostgresStore


def is_pg(store: Store) -> bool:
    return isinstance(store, PostgresStore)


async def ledger(store: Store) -> list[int]:
    assert isinstance(store, PostgresStore)
    return [r["amount"] for r in await store.pool.fetch("SELECT amount FROM test_ledger")]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_repeat_returns_the_stored_result(store: Store, mode: Mode) -> None:
    runs: list[str] = []

    @idempotent_job(store, operation="invoices.send", key="invoice_id", tenant="acme", mode=mode)
    async def send(job: IdempotencyContext, *, invoice_id: str, amount: int) -> dict[str, Any]:
        runs.append(invoice_id)
        if is_pg(store):
            conn = job.connection if mode is Mode.TRANSACTIONAL else await job.fenced_connection()
            await conn.execute(
                "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, $3)",
                job.tenant,
                invoice_id,
                amount,
            )
        return {"sent": invoice_id, "generation": job.generation}

    first = await send(invoice_id="inv-1", amount=7)
    again = await send(invoice_id="inv-1", amount=7)
    assert first == again
    assert first["sent"] == "inv-1"
    assert runs == ["inv-1"]
    record = await store.get(RecordKey("acme", "invoices.send", "inv-1"))
    assert record is not None
    assert record.state is State.SUCCEEDED
    if is_pg(store):
        assert await ledger(store) == [7]
    with pytest.raises(JobKeyReused):
        await send(invoice_id="inv-1", amount=8)


async def test_transactional_failure_rolls_back_and_frees_the_key(store: Store) -> None:
    runs = 0

    @idempotent_job(store, operation="charge", key=lambda event: event["id"])
    async def charge(job: IdempotencyContext, event: dict[str, Any]) -> int:
        nonlocal runs
        runs += 1
        if is_pg(store):
            await job.connection.execute(
                "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('', 'x', 1)"
            )
        if runs == 1:
            raise RuntimeError("the first delivery fails")
        return runs

    with pytest.raises(RuntimeError):
        await charge({"id": "evt-1"})
    assert await store.get(RecordKey("", "charge", "evt-1")) is None
    if is_pg(store):
        assert await ledger(store) == []
    assert await charge({"id": "evt-1"}) == 2
    assert await charge({"id": "evt-1"}) == 2
    assert runs == 2
    if is_pg(store):
        assert await ledger(store) == [1]


async def test_lease_failure_is_unknown_unless_released(store: Store) -> None:
    @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE)
    async def payout(job: IdempotencyContext, *, ref: str, release: bool) -> None:
        if release:
            job.declare(Outcome.RELEASE)
        raise RuntimeError("the bank timed out")

    with pytest.raises(RuntimeError):
        await payout(ref="p1", release=False)
    with pytest.raises(JobOutcomeUnknown):
        await payout(ref="p1", release=False)
    with pytest.raises(RuntimeError):
        await payout(ref="p2", release=True)
    assert await store.get(RecordKey("", "payout", "p2")) is None  # free for the next delivery


async def test_a_concurrent_repeat_waits_then_gives_up(store: Store) -> None:
    entered = asyncio.Event()
    release = asyncio.Event()

    @idempotent_job(store, operation="slow", key="k", wait_seconds=0.2)
    async def slow(job: IdempotencyContext, *, k: str) -> str:
        entered.set()
        await release.wait()
        return "done"

    first = asyncio.create_task(slow(k="same"))
    await entered.wait()
    with pytest.raises(JobInProgress):
        await slow(k="same")
    release.set()
    assert await first == "done"
    assert await slow(k="same") == "done"


async def test_a_job_writes_through_a_claim_session(pool: asyncpg.Pool[Any]) -> None:
    pytest.importorskip("sqlalchemy")
    from sqlalchemy import text

    from idem_middleware.sqla import open_claim_session

    async with PostgresStore(pool=pool) as store:
        for mode in (Mode.TRANSACTIONAL, Mode.LEASE):

            @idempotent_job(store, operation=f"orm-{mode.value}", key="k", mode=mode)
            async def write(job: IdempotencyContext, *, k: str, fail: bool) -> str:
                async with open_claim_session() as session:
                    insert = (
                        "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('', :k, 1)"
                    )
                    await session.execute(text(insert), {"k": k})
                if fail:
                    raise RuntimeError("after the write")
                return k

            with pytest.raises(RuntimeError):
                await write(k=f"{mode.value}-bad", fail=True)
            assert await write(k=f"{mode.value}-ok", fail=False) == f"{mode.value}-ok"
        rows = [r["account_id"] for r in await pool.fetch("SELECT account_id FROM test_ledger")]
        assert sorted(rows) == ["lease-ok", "transactional-ok"]


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "bogus"},
        {"retention_seconds": float("nan")},
        {"wait_seconds": float("inf")},
        {"lease_seconds": 0},
        {"acquire_timeout": -1},
        {"max_serialization_retries": 1.5},
    ],
)
def test_a_job_with_an_option_that_cannot_work_is_refused_when_decorated(
    options: dict[str, Any],
) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(options))):
        idempotent_job(MemoryStore(), operation="charge", key="id", **options)


def test_a_job_that_is_no_async_function_or_has_no_store_is_refused_when_decorated() -> None:
    """Found by probing: a plain function's body ran, effects and all, at every call, before
    the await of what it returned failed (nothing recorded: every retry ran it again); a store
    of None or a pool failed only at the first call."""
    ran: list[str] = []

    def plain(ctx: IdempotencyContext, id: str) -> dict[str, str]:
        ran.append(id)
        return {}

    async def generator(ctx: IdempotencyContext, id: str) -> Any:
        yield id

    job = idempotent_job(MemoryStore(), operation="charge", key="id")
    for function in (plain, generator):
        with pytest.raises(ConfigurationError, match="a job is an async function"):
            job(function)  # type: ignore[arg-type]
    assert ran == []
    for store in (None, object()):
        with pytest.raises(ConfigurationError, match="a job's store is a PostgresStore"):
            idempotent_job(store, operation="charge", key="id")  # type: ignore[arg-type]


async def test_a_jobs_mode_given_as_its_value_is_the_mode() -> None:
    store = MemoryStore()

    @idempotent_job(store, operation="charge", key="id", mode="lease")  # type: ignore[arg-type]
    async def charge(ctx: IdempotencyContext, id: str) -> int:
        return 1

    assert await charge(id="x") == 1
    summary = await store.describe(RecordKey("", "charge", "x"))
    assert summary is not None
    assert summary.mode == "lease"


async def test_a_concurrent_repeat_waits_for_the_first_runs_transaction(store: Store) -> None:
    """Found by probing: a concurrent repeat of a transactional job raised JobInProgress at once
    (the claim's "busy" is a kind of timeout, and was caught as one) instead of waiting up to
    `wait_seconds` for the first run."""
    runs: list[int] = []
    entered = asyncio.Event()

    @idempotent_job(store, operation="slow", key="k", wait_seconds=5)
    async def slow(ctx: IdempotencyContext, k: str, v: int) -> int:
        runs.append(v)
        entered.set()
        await asyncio.sleep(0.3)
        return v

    first = asyncio.ensure_future(slow(k="a", v=1))
    await asyncio.wait_for(entered.wait(), 5)
    same = asyncio.ensure_future(slow(k="a", v=1))
    other = asyncio.ensure_future(slow(k="a", v=2))
    assert await asyncio.wait_for(first, 5) == 1
    assert await asyncio.wait_for(same, 5) == 1  # the stored result, after the wait
    with pytest.raises(JobKeyReused):
        await asyncio.wait_for(other, 5)
    assert runs == [1]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_key_is_counted_in_bytes_as_the_database_counts_it(
    store: Store, mode: Mode
) -> None:
    """Found by probing: 128 "é" are 128 characters and 256 bytes; the job ran on every call
    and its record was refused at commit."""
    runs: list[str] = []

    @idempotent_job(store, operation="send", key="k", mode=mode)
    async def send(ctx: IdempotencyContext, k: str) -> int:
        runs.append(k)
        return 1

    with pytest.raises(ValueError, match="bytes"):
        await send(k="\u00e9" * 128)
    assert await send(k="\u00e9" * 127) == 1
    assert await send(k="\u00e9" * 127) == 1
    assert runs == ["\u00e9" * 127]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
async def test_arguments_json_cannot_tell_from_null_are_refused(value: float) -> None:
    """orjson writes NaN and the infinities as null: `v=inf` and `v=-inf` would be one call."""

    @idempotent_job(MemoryStore(), operation="f", key="k")
    async def f(ctx: IdempotencyContext, k: str, v: Any) -> int:
        return 1

    with pytest.raises(ConfigurationError, match="NaN"):
        await f(k="i", v={"nested": [value]})
    assert await f(k="j", v=None) == 1  # a null of its own is fine


async def test_a_takeover_waits_for_a_fenced_run_no_longer_than_the_jobs_wait(
    pg_store: PostgresStore,
) -> None:
    """A run whose lease lapsed may still hold its fenced transaction (the record's row lock):
    the job's next call gives up after its `wait_seconds` with JobInProgress, as a request
    does, instead of waiting as long as that transaction lasts."""
    from idem_middleware.jobs import _fingerprint
    from idem_middleware.policy import LeaseExpiry

    @idempotent_job(
        pg_store,
        operation="payout",
        key="ref",
        mode=Mode.LEASE,
        wait_seconds=0.3,
        on_lease_expiry=LeaseExpiry.TAKEOVER,
    )
    async def payout(job: IdempotencyContext, *, ref: str) -> str:
        return "paid"

    key = RecordKey("", "payout", "r1")
    fingerprint = _fingerprint("payout", (), {"ref": "r1"})
    claim = await pg_store.claim_lease(key, fingerprint, retention_seconds=60, lease_seconds=0.1)
    assert isinstance(claim, Claimed)
    async with pg_store.fenced(key, claim.generation, State.PENDING):
        await asyncio.sleep(0.2)  # the lease lapses; the fenced transaction holds the row
        with pytest.raises(JobInProgress):
            await asyncio.wait_for(payout(ref="r1"), 10)
    assert await payout(ref="r1") == "paid"  # the fence gone, the takeover goes through


async def test_a_lapsed_run_still_in_its_fenced_transaction_is_waited_for_not_marked_unknown(
    pg_store: PostgresStore,
) -> None:
    """The default `on_lease_expiry` (unknown): a run whose lease lapsed but which still holds
    its fenced transaction makes the next call's `expire_lease` meet a busy row (NOWAIT). That
    is waited for in the process, as a request's is: JobInProgress after `wait_seconds`, the
    record left pending (no driver error, no `unknown` under a run that may still settle); once
    the fence is gone, the lapsed run is marked unknown."""
    from idem_middleware.jobs import _fingerprint

    @idempotent_job(pg_store, operation="payout", key="ref", mode=Mode.LEASE, wait_seconds=0.3)
    async def payout(job: IdempotencyContext, *, ref: str) -> str:
        return "paid"

    key = RecordKey("", "payout", "r2")
    fingerprint = _fingerprint("payout", (), {"ref": "r2"})
    claim = await pg_store.claim_lease(key, fingerprint, retention_seconds=60, lease_seconds=0.1)
    assert isinstance(claim, Claimed)
    async with pg_store.fenced(key, claim.generation, State.PENDING):
        await asyncio.sleep(0.2)  # the lease lapses; the fenced transaction holds the row
        with pytest.raises(JobInProgress):
            await asyncio.wait_for(payout(ref="r2"), 10)
        record = await pg_store.get(key)
        assert record is not None
        assert record.state is State.PENDING
    with pytest.raises(JobOutcomeUnknown):
        await asyncio.wait_for(payout(ref="r2"), 10)


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_repeat_of_a_job_that_returned_none_returns_none(store: Store, mode: Mode) -> None:
    """Found by probing: a job that returned None stored `null`, and a repeat read that None as
    "not settled yet": JobInProgress at once (transactional), or after `wait_seconds` (lease),
    on every redelivery, instead of the stored result."""
    runs: list[str] = []

    @idempotent_job(store, operation="notify", key="k", mode=mode, wait_seconds=0.2)
    async def notify(job: IdempotencyContext, *, k: str) -> None:
        runs.append(k)

    assert await notify(k="n1") is None
    assert await asyncio.wait_for(notify(k="n1"), 10) is None
    assert runs == ["n1"]


async def test_a_key_or_tenant_that_cannot_be_one_is_refused_before_the_claim(
    store: Store,
) -> None:
    """Found by probing: a key argument that was None became the key "None" (every call without
    a key shared one record: the second got the first's result, or JobKeyReused); a tenant
    function's None became the tenant "None"; a NUL in the key or the tenant reached
    PostgreSQL as a raw driver error."""
    runs: list[Any] = []

    @idempotent_job(store, operation="send", key="k", tenant=lambda **kw: kw["account"])
    async def send(ctx: IdempotencyContext, *, k: Any, account: Any) -> int:
        runs.append(k)
        return len(runs)

    with pytest.raises(ValueError, match="is None"):
        await send(k=None, account="a")
    with pytest.raises(ValueError, match="tenant is None"):
        await send(k="k1", account=None)
    for k, account in (("a\x00b", "a"), ("k1", "a\x00")):
        with pytest.raises(ValueError, match="NUL"):
            await send(k=k, account=account)
    assert runs == []
    assert await send(k=7, account="a") == 1  # an int is its digits, as ever
    assert await send(k=7, account="a") == 1


@pytest.mark.parametrize("options", [{"key": ""}, {"key": 5}, {"tenant": None}, {"tenant": 3}])
def test_a_job_whose_key_or_tenant_cannot_work_is_refused_when_decorated(
    options: dict[str, Any],
) -> None:
    """Found by probing: `key=""` failed every call ("pass the idempotency key argument ''"),
    and `tenant=None` put every call in the tenant "None"."""
    with pytest.raises(ConfigurationError, match=next(iter(options))):
        idempotent_job(MemoryStore(), **{"operation": "charge", "key": "id", **options})


async def test_a_renewal_waiting_on_the_jobs_own_fence_is_no_lost_lease(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: a job writing on its fenced connection holds the record's row lock, so
    a renewal due meanwhile waits for it; the run settled, the renewal matched nothing, and a
    successful job logged "job lease lost" (and set `lease_lost`), as the HTTP executor does
    not."""
    seen: list[IdempotencyContext] = []

    @idempotent_job(pg_store, operation="fenced", key="k", mode=Mode.LEASE, lease_seconds=0.3)
    async def write(job: IdempotencyContext, *, k: str) -> str:
        seen.append(job)
        conn = await job.fenced_connection()
        await conn.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('', $1, 1)", k
        )
        await asyncio.sleep(0.25)  # past the first renewal (a third of the lease)
        return k

    with caplog.at_level("WARNING", logger="idem_middleware"):
        assert await write(k="f1") == "f1"
    assert not [r for r in caplog.records if "lease lost" in r.getMessage()]
    assert not seen[0].lease_lost.is_set()


async def test_a_transactional_repeat_waits_for_a_lease_mode_run_of_its_key(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by probing: a job moved from lease mode to transactional (a deploy, or two
    decorations of one operation) whose repeat met the lease-mode run still going raised
    JobInProgress at once, whatever its `wait_seconds`. It now waits for that run (holding no
    connection, claiming again as it polls) and returns its result; it never runs it again."""
    gate = asyncio.Event()
    entered = asyncio.Event()
    runs: list[Mode] = []

    def job_in(mode: Mode) -> Any:
        @idempotent_job(store, operation="payout", key="ref", mode=mode, wait_seconds=10)
        async def payout(job: IdempotencyContext, *, ref: str) -> str:
            runs.append(mode)
            entered.set()
            await gate.wait()
            return f"paid in {mode}"

        return payout

    old, new = job_in(Mode.LEASE), job_in(Mode.TRANSACTIONAL)
    running = asyncio.ensure_future(old(ref="r1"))
    try:
        await asyncio.wait_for(entered.wait(), 10)
        # The gate opens once the repeat has found the run going (its claim met the record).
        seen = asyncio.Event()
        answer = JobSpec.answer

        def answered(spec: JobSpec, record: Any, fingerprint: bytes) -> Any:
            seen.set()
            return answer(spec, record, fingerprint)

        monkeypatch.setattr(JobSpec, "answer", answered)
        repeat = asyncio.ensure_future(new(ref="r1"))
        await asyncio.wait_for(seen.wait(), 10)
        gate.set()
        assert await asyncio.wait_for(running, 10) == "paid in lease"
        assert await asyncio.wait_for(repeat, 10) == "paid in lease"
    finally:
        gate.set()
        running.cancel()
    assert runs == [Mode.LEASE]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_jobs_operation_too_long_for_the_records_key_is_refused_when_decorated(
    pg_store: PostgresStore, mode: Mode
) -> None:
    """Found by probing: an operation of any length was taken, and one the record's primary key
    cannot hold beside its tenant and key (incompressible, about 1,400 bytes and more) failed
    every run: the claim with asyncpg's ProgramLimitExceededError (lease mode), or the completion
    after the function ran (transactional). Refused when decorated; at the limit, with the
    longest tenant and key, a run is recorded and replayed."""
    from idem_middleware.jobs import MAX_OPERATION_BYTES
    from idem_middleware.tenant import MAX_TENANT_BYTES

    # (hex digits of random bytes: the database cannot compress them below the index's limit)
    operation, tenant = secrets.token_hex(MAX_OPERATION_BYTES // 2), secrets.token_hex(512)
    assert len(tenant) == MAX_TENANT_BYTES
    with pytest.raises(ConfigurationError, match="operation"):
        idempotent_job(pg_store, operation=operation + "x", key="k", mode=mode)
    with pytest.raises(ConfigurationError, match="operation"):
        idempotent_job(pg_store, operation="é" * (MAX_OPERATION_BYTES // 2 + 1), key="k")
    runs: list[str] = []

    @idempotent_job(pg_store, operation=operation, key="k", tenant=tenant, mode=mode)
    async def job(ctx: IdempotencyContext, *, k: str) -> int:
        runs.append(k)
        return len(k)

    key = secrets.token_hex(127) + "k"
    assert await job(k=key) == await job(k=key) == 255
    assert runs == [key]
