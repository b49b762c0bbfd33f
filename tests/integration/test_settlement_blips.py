"""A lease-mode settlement that fails on a blip (resettle.py): the store's PostgreSQL stopped and
started again while the settlement is sent, on a server of this module's own (tests/restarts.py),
or the answer to a settlement that committed lost. Every wait ends on a condition, in bounded
loops.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext, Policy, PostgresStore, get_context
from idem_middleware.errors import JobOutcomeUnknown, StoreError
from idem_middleware.jobs import idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey, Settlement, State
from tests.apps import assert_problem, assert_replay_of, client, one_route_app
from tests.restarts import OwnServer

#: The most any condition is waited for (a bound, not a timing: each wait ends on its condition).
BOUND = 30.0

KEY = RecordKey("tenant-a", "POST /charges", "blip")
HEADERS = {"Idempotency-Key": "blip"}
#: Long enough that a third of it (the settlement's time to try again) covers a restart.
POLICY = Policy(mode=Mode.LEASE, lease_seconds=60.0, wait_seconds=0.3)


class SettleLog(PostgresStore):
    """Notes each compare-and-set settlement: its state, and whether it raised."""

    settlements: list[tuple[State, bool]]
    #: Raise after the first settlement committed, as if its answer were lost on the way back.
    lose_first_answer = False

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        try:
            settled = await super().settle(key, generation, expected, s)
        except StoreError:
            self.settlements.append((s.state, False))
            raise
        if self.lose_first_answer and not self.settlements:
            self.settlements.append((s.state, False))
            raise StoreError("ConnectionDoesNotExistError: connection was closed")
        self.settlements.append((s.state, True))
        return settled


async def until(predicate: Any, what: str) -> None:
    for _ in range(int(BOUND / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def charges(fence: bool) -> tuple[Any, asyncio.Event, asyncio.Event]:
    entered, release = asyncio.Event(), asyncio.Event()

    async def charge(request: Request) -> Response:
        ctx = get_context(request)
        if fence:
            conn = await ctx.fenced_connection()
            await conn.execute("SELECT 1")
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return JSONResponse({"charged": True}, status_code=201)

    return charge, entered, release


async def test_a_settlement_sent_while_the_server_restarts_is_recorded_once_it_is_back(
    own_server: OwnServer, own_dsn: str
) -> None:
    """The handler (no fenced transaction) answers 201 while the server is down: its settlement
    fails. It was marked `unknown` at once (or, with the server still down, left `pending` until
    its lease lapsed) and its client answered 503, though the charge happened. Now the same
    compare-and-set is sent again, with no connection held between tries, and once the server
    is back the outcome is recorded and the client gets its 201; a retry replays it."""
    charge, entered, release = charges(fence=False)
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            await asyncio.to_thread(own_server.stop)
            try:
                release.set()
                await until(lambda: store.settlements, "a settlement tried with the server down")
            finally:
                await asyncio.to_thread(own_server.start)
            response = await asyncio.wait_for(first, BOUND)
            assert response.status_code == 201, response.text
            assert store.settlements[0] == (State.SUCCEEDED, False)
            assert store.settlements[-1] == (State.SUCCEEDED, True)
            assert {state for state, _ in store.settlements} == {State.SUCCEEDED}
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.SUCCEEDED
            assert_replay_of(await c.post("/charges", json={}, headers=HEADERS), response)


async def test_a_settlement_whose_answer_was_lost_after_it_committed_is_the_clients_answer(
    own_dsn: str,
) -> None:
    """The settlement committed, and its answer was lost (the connection died on the way back):
    the executor marked the record `unknown`, which changed nothing (it was settled), and
    answered 503 for a request whose outcome was recorded. Sent again, the compare-and-set finds
    no pending record, and the record shows this settlement: the client gets its 201."""
    charge, _, release = charges(fence=False)
    release.set()
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []
        store.lose_first_answer = True
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
        async with client(app) as c:
            response = await asyncio.wait_for(c.post("/charges", json={}, headers=HEADERS), BOUND)
            assert response.status_code == 201, response.text
            assert store.settlements == [(State.SUCCEEDED, False), (State.SUCCEEDED, True)]
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.SUCCEEDED
            assert_replay_of(await c.post("/charges", json={}, headers=HEADERS), response)


async def test_a_fenced_settlement_that_failed_is_not_sent_again(
    own_server: OwnServer, own_dsn: str
) -> None:
    """With a fenced transaction, the failed settlement's COMMIT took the handler's writes with
    it: the outcome is not recorded alone. The client is answered 503 and the record is marked
    `unknown`, that mark sent again until the server is back (it was tried once, and the record
    left `pending` until its lease lapsed)."""
    charge, entered, release = charges(fence=True)
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            await asyncio.to_thread(own_server.stop)
            try:
                release.set()
                await until(lambda: store.settlements, "an unknown mark tried with the server down")
            finally:
                await asyncio.to_thread(own_server.start)
            response = await asyncio.wait_for(first, BOUND)
            assert_problem(response, 503, "store-unavailable")
            # Only marks of `unknown`, never the 201 alone.
            assert {state for state, _ in store.settlements} == {State.UNKNOWN}
            assert store.settlements[-1] == (State.UNKNOWN, True)
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.UNKNOWN
            retry = await c.post("/charges", json={}, headers=HEADERS)
            assert_problem(retry, 409, "outcome-unknown")


def raising(fence: bool) -> tuple[Any, asyncio.Event, asyncio.Event]:
    """A handler that raises once released (after its fenced write, with `fence`)."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def charge(request: Request) -> Response:
        ctx = get_context(request)
        if fence:
            conn = await ctx.fenced_connection()
            await conn.execute("SELECT 1")
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        raise RuntimeError("the bank's answer was lost")

    return charge, entered, release


@pytest.mark.parametrize("fence", [False, True], ids=["no-fence", "fenced"])
async def test_a_raising_handlers_unknown_mark_sent_while_the_server_restarts_is_recorded(
    own_server: OwnServer, own_dsn: str, fence: bool
) -> None:
    """The handler raises while the server is down: the record must become `unknown` (the
    charge may have happened). The one try to mark it failed, the store's error replaced the
    handler's, and the record stayed `pending` until its lease lapsed: a retry was told
    `request-in-flight` for a minute, not `outcome-unknown`. Now the mark is sent again, like a
    settlement, and recorded once the server is back."""
    charge, entered, release = raising(fence)
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
        async with client(app) as c:
            first = asyncio.create_task(c.post("/charges", json={}, headers=HEADERS))
            await asyncio.wait_for(entered.wait(), BOUND)
            await asyncio.to_thread(own_server.stop)
            try:
                release.set()
                await until(lambda: store.settlements, "an unknown mark tried with the server down")
            finally:
                await asyncio.to_thread(own_server.start)
            response = await asyncio.wait_for(first, BOUND)
            assert response.status_code == 500, response.text  # the handler's own error
            assert store.settlements[0] == (State.UNKNOWN, False)
            assert store.settlements[-1] == (State.UNKNOWN, True)
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.UNKNOWN
            retry = await c.post("/charges", json={}, headers=HEADERS)
            assert_problem(retry, 409, "outcome-unknown")


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
async def test_a_lease_jobs_settlement_sent_while_the_server_restarts_is_recorded(
    own_server: OwnServer, own_dsn: str, raises: bool
) -> None:
    """A lease-mode job (no fenced transaction) ends while the server is down: its result, or
    the `unknown` its exception leaves, was tried once. The StoreError replaced the result (or
    the job's own error), and the record stayed `pending` until its lease lapsed: the queue's
    redelivery raised JobInProgress, then JobOutcomeUnknown (with TAKEOVER: the job ran
    again) for a job that had done its work. Now the settlement is sent again, as a request's
    is, and recorded once the server is back."""
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[str] = []
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        store.settlements = []

        @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=60.0)
        async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
            runs.append(ref)
            entered.set()
            await asyncio.wait_for(release.wait(), BOUND)
            if raises:
                raise RuntimeError("the bank's answer was lost")
            return {"paid": ref}

        first = asyncio.create_task(payout(ref="p1"))
        await asyncio.wait_for(entered.wait(), BOUND)
        await asyncio.to_thread(own_server.stop)
        try:
            release.set()
            await until(lambda: store.settlements, "a settlement tried with the server down")
        finally:
            await asyncio.to_thread(own_server.start)
        state = State.UNKNOWN if raises else State.SUCCEEDED
        if raises:
            with pytest.raises(RuntimeError, match="the bank's answer was lost"):
                await asyncio.wait_for(first, BOUND)
            with pytest.raises(JobOutcomeUnknown):
                await payout(ref="p1")
        else:
            assert await asyncio.wait_for(first, BOUND) == {"paid": "p1"}
            assert await payout(ref="p1") == {"paid": "p1"}
        assert runs == ["p1"]
        assert store.settlements[0] == (state, False)
        assert store.settlements[-1] == (state, True)
        record = await store.get(RecordKey("", "payout", "p1"))
        assert record is not None
        assert record.state is state


class LoseFencedAnswer(PostgresStore):
    """Its fenced sessions' settlements commit, then raise as if the answer to the COMMIT was
    lost on the way back (the connection died after the server committed)."""

    def fenced(self, key: RecordKey, generation: int, expected: State) -> Any:
        return _LosingFencing(super().fenced(key, generation, expected))


class _LosingFencing:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> Any:
        return _LosingSession(await self.inner.__aenter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.inner.__aexit__(*exc)


class _LosingSession:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.connection = inner.connection

    async def settle(self, s: Settlement) -> bool:
        await self.inner.settle(s)
        raise StoreError("ConnectionDoesNotExistError: connection was closed")


async def test_a_fenced_settlement_whose_answer_was_lost_after_it_committed_is_the_clients_answer(
    own_dsn: str,
) -> None:
    """The fenced transaction (the handler's writes and its outcome) committed, and the answer
    to its COMMIT was lost: marking the record `unknown` changed nothing (it was settled), and
    the client was answered 503 for a request whose writes and outcome were committed. Now the
    record is read: it holds this generation's outcome, so the client gets its 201."""
    charge, _, release = charges(fence=True)
    release.set()
    async with LoseFencedAnswer(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
        async with client(app) as c:
            response = await asyncio.wait_for(c.post("/charges", json={}, headers=HEADERS), BOUND)
            assert response.status_code == 201, response.text
            record = await store.get(KEY)
            assert record is not None
            assert record.state is State.SUCCEEDED
            assert_replay_of(await c.post("/charges", json={}, headers=HEADERS), response)


async def test_a_lease_jobs_fenced_settlement_whose_answer_was_lost_after_it_committed_returns(
    own_dsn: str,
) -> None:
    """A lease-mode job's fenced transaction (its writes and its result) committed, and the
    answer to its COMMIT was lost: the job raised StoreError for a run whose writes and result
    were committed (the queue's redelivery then got the result: one run, but a failed job in
    the consumer's eyes). Now the record is read, as a request's is, and the job returns."""
    runs: list[str] = []
    async with LoseFencedAnswer(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:

        @idempotent_job(store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=60.0)
        async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
            runs.append(ref)
            conn = await job.fenced_connection()
            await conn.execute("SELECT 1")
            return {"paid": ref}

        assert await asyncio.wait_for(payout(ref="p1"), BOUND) == {"paid": "p1"}
        record = await store.get(RecordKey("", "payout", "p1"))
        assert record is not None
        assert record.state is State.SUCCEEDED
        assert await payout(ref="p1") == {"paid": "p1"}
        assert runs == ["p1"]
