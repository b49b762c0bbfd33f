"""A handler's work in tasks of its own. A task group (asyncio's `TaskGroup`, anyio's) wraps
what its tasks raise in an ExceptionGroup: a serialization failure or a deadlock inside one was
a 500 (transactional requests and jobs run again on one raised plainly), and a lease-mode fenced
connection lost inside one a 500 (a 503 plainly). And a task an attempt started that outlives
it: after a conflict the request runs again under a new claim, and the old task found the new
claim in the scope and wrote into it, so one request committed its effect twice.
"""

from __future__ import annotations

import asyncio

import asyncpg
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import (
    IdempotencyContext,
    MemoryStore,
    Mode,
    Policy,
    PostgresStore,
    get_context,
)
from idem_middleware.jobs import idempotent_job
from tests.apps import BOUND, LEDGER_INSERT, client, count, one_route_app
from tests.apps.checks import assert_problem


def serialization_failure() -> asyncpg.PostgresError:
    return asyncpg.exceptions.SerializationError("could not serialize access")


async def in_a_task_group(*errors: BaseException) -> None:
    """Raises `errors` from tasks of a TaskGroup: an ExceptionGroup of them."""

    async def fails(error: BaseException) -> None:
        raise error

    async with asyncio.TaskGroup() as group:
        for error in errors:
            group.create_task(fails(error))


async def test_a_conflict_inside_a_task_group_runs_the_attempt_again(
    pg_store: PostgresStore, pool: asyncpg.Pool
) -> None:
    runs: list[int] = []

    async def handler(request: Request) -> Response:
        connection = get_context(request).connection
        await connection.execute(LEDGER_INSERT, "tenant-a", "acc", 1)
        runs.append(1)
        if len(runs) == 1:
            await in_a_task_group(serialization_failure(), serialization_failure())
        return JSONResponse({"runs": len(runs)}, status_code=201)

    app = one_route_app("/pay", handler, store=pg_store)
    async with client(app) as c:
        first = await c.post("/pay", json={}, headers={"Idempotency-Key": "grouped"})
    assert first.status_code == 201, first.text  # (a 500 before)
    assert len(runs) == 2
    assert await count(pool, "test_ledger") == 1  # the first attempt's write rolled back


async def test_a_group_with_another_error_is_the_handlers_error(pg_store: PostgresStore) -> None:
    """Run again only when every error in the group is a conflict: one that is not is the
    handler's failure (a 500, nothing committed), not a reason to run its effects again."""
    runs: list[int] = []

    async def handler(request: Request) -> Response:
        get_context(request)
        runs.append(1)
        await in_a_task_group(serialization_failure(), ValueError("a bug"))
        return JSONResponse({}, status_code=201)

    app = one_route_app("/pay", handler, store=pg_store)
    async with client(app) as c:
        failed = await c.post("/pay", json={}, headers={"Idempotency-Key": "mixed"})
    assert failed.status_code == 500
    assert runs == [1]


async def test_a_task_of_an_earlier_attempt_cannot_use_the_new_claim(
    pg_store: PostgresStore, pool: asyncpg.Pool
) -> None:
    attempts: list[int] = []
    second_began = asyncio.Event()
    helper_saw: list[object] = []

    async def ledger(request: Request) -> None:
        await asyncio.wait_for(second_began.wait(), BOUND)
        try:
            connection = get_context(request).connection
        except LookupError as error:
            helper_saw.append(error)
            return
        await connection.execute(LEDGER_INSERT, "tenant-a", "acc", 1)
        helper_saw.append("wrote into the new claim")

    async def handler(request: Request) -> Response:
        attempts.append(1)
        if len(attempts) == 1:
            # (`gather` leaves the other task running when one raises)
            await asyncio.gather(ledger(request), _raises(serialization_failure()))
        second_began.set()
        await get_context(request).connection.execute(LEDGER_INSERT, "tenant-a", "acc", 1)
        await asyncio.wait_for(_until(lambda: bool(helper_saw)), BOUND)
        return JSONResponse({}, status_code=201)

    app = one_route_app("/pay", handler, store=pg_store)
    async with client(app) as c:
        done = await c.post("/pay", json={}, headers={"Idempotency-Key": "leftover"})
    assert done.status_code == 201, done.text
    assert len(attempts) == 2
    assert isinstance(helper_saw[0], LookupError), helper_saw
    assert await count(pool, "test_ledger") == 1  # (2 before: the effect twice)


async def test_a_worker_another_request_started_serves_later_requests() -> None:
    """The refusal above is for the same request's earlier attempt only: a worker task the first
    request started (it inherited that request's context, which has ended) acting for later,
    live requests gets their claims, as before."""
    queue: asyncio.Queue[tuple[Request, asyncio.Future[None]]] = asyncio.Queue()
    workers: list[asyncio.Task[None]] = []

    async def work() -> None:
        for _ in range(3):
            request, done = await queue.get()
            try:
                get_context(request)
            except LookupError as error:
                done.set_exception(error)
            else:
                done.set_result(None)

    async def handler(request: Request) -> Response:
        if not workers:  # (started by the first request, lazily)
            workers.append(asyncio.create_task(work()))
        done = asyncio.get_running_loop().create_future()
        await queue.put((request, done))
        await asyncio.wait_for(done, BOUND)
        return JSONResponse({}, status_code=201)

    app = one_route_app("/pay", handler, store=MemoryStore())
    async with client(app) as c:
        answers = [
            await c.post("/pay", json={}, headers={"Idempotency-Key": f"k{n}"}) for n in range(3)
        ]
    await asyncio.wait_for(workers[0], BOUND)
    assert [answer.status_code for answer in answers] == [201, 201, 201]


async def test_a_job_whose_task_group_meets_a_conflict_runs_again(pg_store: PostgresStore) -> None:
    runs: list[int] = []

    @idempotent_job(pg_store, operation="grouped", key="key")
    async def job(context: IdempotencyContext, key: str) -> int:
        runs.append(1)
        if len(runs) == 1:
            await in_a_task_group(serialization_failure())
        return len(runs)

    assert await job(key="k") == 2  # (the ExceptionGroup reached the caller before)


async def test_a_fenced_connection_lost_inside_a_task_group_is_a_503(
    pg_store: PostgresStore, pool: asyncpg.Pool
) -> None:
    async def write(connection: asyncpg.Connection) -> None:
        await connection.execute(LEDGER_INSERT, "tenant-a", "acc", 1)

    async def handler(request: Request) -> Response:
        connection = await get_context(request).fenced_connection()
        pid = await connection.fetchval("SELECT pg_backend_pid()")
        await pool.execute("SELECT pg_terminate_backend($1)", pid)
        async with asyncio.TaskGroup() as group:
            group.create_task(write(connection))
        return JSONResponse({}, status_code=201)

    policy = Policy(mode=Mode.LEASE, lease_seconds=5.0)
    app = one_route_app("/pay", handler, store=pg_store, policies={"POST /pay": policy})
    async with client(app) as c:
        lost = await c.post("/pay", json={}, headers={"Idempotency-Key": "lost"})
    assert_problem(lost, 503, "store-unavailable")  # (a plain 500 before)
    assert await count(pool, "test_ledger") == 0


async def _raises(error: BaseException) -> None:
    await asyncio.sleep(0)
    raise error


async def _until(done: object) -> None:
    assert callable(done)
    for _ in range(int(BOUND / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)
