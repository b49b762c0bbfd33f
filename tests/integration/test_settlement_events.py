"""What the observers count of a claimed request whose outcome the store could not record: its
handler left the claim's (or the fenced) transaction unable to record it, authentication inside
the middleware named its anonymous caller late, or its connection died. Such a request is
counted `claimed`, then once by what became of it: `released` in transactional mode (the
transaction rolled back, the key free), `unresolved` in lease mode (the record `unknown`). It
was counted `rejected` too (`refused before a claim`: docs/observability.md), or `error` after
the mode had counted it; OpenTelemetry's span then showed the last of them as its outcome."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.errors import ProblemKind, StoreError
from idem_middleware.observe import Event, store_error_event
from tests.apps import assert_problem, client, one_route_app, records, until
from tests.integration.test_callback_refusals import Recorder
from tests.integration.test_http_failures import connection_closed

CLAIMED, RELEASED, UNRESOLVED = Event.CLAIMED, Event.RELEASED, Event.UNRESOLVED
#: What became of a claim whose outcome could not be recorded, by mode.
ENDED = {Mode.TRANSACTIONAL: RELEASED, Mode.LEASE: UNRESOLVED}
MODES = [Mode.TRANSACTIONAL, Mode.LEASE]


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pool=pool) as store:
        yield store


async def _connection(request: Request, mode: Mode) -> Any:
    """The claim's connection (transactional) or the fenced one (lease mode)."""
    ctx = get_context(request)
    return ctx.connection if mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()


def _answer(request: Request) -> Response:
    if request.query_params.get("stream"):  # settled before its first byte
        return StreamingResponse(iter([b'{"ok": 1}']), status_code=201)
    return JSONResponse({"ok": 1}, status_code=201)


async def _one(app: Starlette, url: str = "/charges", **options: Any) -> httpx.Response:
    async with client(app, **options) as c:
        return await asyncio.wait_for(c.post(url, json={}, headers={"idempotency-key": "k1"}), 10)


@pytest.mark.parametrize("stream", [False, True], ids=["held", "streamed"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_refused_settlement_is_counted_by_what_became_of_it(
    store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode, stream: bool
) -> None:
    """The handler goes on after one of its statements failed (aborting the transaction) and
    answers 201: 500 server-misconfigured, never counted `rejected`."""

    async def handler(request: Request) -> Response:
        await request.body()
        with contextlib.suppress(asyncpg.DivisionByZeroError):  # (the transaction is aborted)
            await (await _connection(request, mode)).execute("SELECT 1/0")
        return _answer(request)

    recorder = Recorder()
    policies = {"POST /charges": Policy(mode=mode)}
    app = one_route_app("/charges", handler, store=store, observers=[recorder], policies=policies)
    response = await _one(app, "/charges?stream=1" if stream else "/charges")
    assert_problem(response, 500, "server-misconfigured")
    assert recorder.events == [CLAIMED, ENDED[mode]]
    states = [row["state"] for row in await records(pool)]
    assert states == ([] if mode is Mode.TRANSACTIONAL else ["unknown"])


@pytest.mark.parametrize("stream", [False, True], ids=["held", "streamed"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_caller_named_late_is_counted_by_what_became_of_it(
    store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode, stream: bool
) -> None:
    """Claimed as anonymous, its caller named by the time its outcome is to be recorded
    (CallerNamedLate): 500 server-misconfigured, nothing recorded under the anonymous tenant,
    never counted `rejected`."""

    async def handler(request: Request) -> Response:
        await request.body()
        request.state.tenant = "tenant-a"  # what an authentication inside would set
        return _answer(request)

    def resolver(scope: Any) -> str | None:
        tenant: str | None = (scope.get("state") or {}).get("tenant")
        return tenant

    recorder = Recorder()
    app = Starlette(
        routes=[Route("/charges", handler, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                observers=[recorder],
                tenant_resolver=resolver,
                default_policy=Policy(mode=mode, allow_anonymous=True),
            )
        ],
    )
    response = await _one(app, "/charges?stream=1" if stream else "/charges", token=None)
    assert_problem(response, 500, "server-misconfigured")
    assert recorder.events == [CLAIMED, ENDED[mode]]
    states = [(row["tenant"], row["state"]) for row in await records(pool)]
    assert states == ([] if mode is Mode.TRANSACTIONAL else [("", "unknown")])


@pytest.mark.parametrize("mode", MODES)
async def test_a_connection_lost_under_the_handler_is_counted_once(
    store: PostgresStore, pool: asyncpg.Pool[Any], mode: Mode
) -> None:
    """The handler's connection dies (the mode counts the claim's end: the transaction rolled
    back, or the record marked unknown) and the client is told 503: not counted `error` too."""

    async def handler(request: Request) -> Response:
        await request.body()
        conn = await _connection(request, mode)
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        await until(lambda: connection_closed(conn))
        await conn.execute("SELECT 1")  # raises: the connection is gone
        return _answer(request)

    recorder = Recorder()
    policies = {"POST /charges": Policy(mode=mode)}
    app = one_route_app("/charges", handler, store=store, observers=[recorder], policies=policies)
    assert_problem(await _one(app), 503, "store-unavailable")
    assert recorder.events == [CLAIMED, ENDED[mode]]


async def test_a_retried_attempt_whose_claim_fails_is_counted_an_error(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transactional: the first attempt's handler met a serialization failure (counted
    `released`), and the store is unreachable when the attempt runs again: that is counted
    `error`, as for any request the store failed before its claim."""
    transaction = store.transaction

    class Unreachable:
        async def __aenter__(self) -> None:
            raise StoreError("unreachable")

        async def __aexit__(self, *exc: object) -> None: ...

    async def handler(request: Request) -> Response:
        await request.body()
        unreachable: Callable[..., Unreachable] = lambda **options: Unreachable()  # noqa: E731
        monkeypatch.setattr(store, "transaction", unreachable)  # from the next attempt on
        raise asyncpg.SerializationError("could not serialize access")

    recorder = Recorder()
    app = one_route_app("/charges", handler, store=store, observers=[recorder])
    try:
        assert_problem(await _one(app), 503, "store-unavailable")
    finally:
        monkeypatch.setattr(store, "transaction", transaction)
    assert recorder.events == [CLAIMED, RELEASED, Event.ERROR]


async def test_a_serialization_failure_at_commit_counts_the_first_claims_end(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """Transactional: the claim's COMMIT fails with a serialization failure (a deferred
    trigger's, here, once), so the attempt runs again: the first claim's end is counted
    `released` before the second claim, not left out (`claimed, claimed, succeeded`)."""
    await pool.execute(
        """
        DROP TABLE IF EXISTS test_commit_once;
        DROP SEQUENCE IF EXISTS test_commit_once_tries;
        CREATE TABLE test_commit_once (id int);
        CREATE SEQUENCE test_commit_once_tries;  -- (not rolled back: the first COMMIT only)
        CREATE OR REPLACE FUNCTION test_commit_once_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('test_commit_once_tries') = 1 THEN
                RAISE EXCEPTION 'could not serialize' USING ERRCODE = 'serialization_failure';
            END IF;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER test_commit_once_trigger AFTER INSERT ON test_commit_once
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_commit_once_fail();
        """
    )

    async def handler(request: Request) -> Response:
        await request.body()
        await get_context(request).connection.execute("INSERT INTO test_commit_once VALUES (1)")
        return JSONResponse({"ok": 1}, status_code=201)

    recorder = Recorder()
    app = one_route_app("/charges", handler, store=store, observers=[recorder])
    try:
        response = await _one(app)
        rows = await pool.fetchval("SELECT count(*) FROM test_commit_once")
    finally:
        await pool.execute(
            "DROP TABLE test_commit_once; DROP FUNCTION test_commit_once_fail();"
            " DROP SEQUENCE test_commit_once_tries"
        )
    assert response.status_code == 201
    assert rows == 1  # (the first attempt's insert rolled back with its claim)
    assert recorder.events == [CLAIMED, RELEASED, CLAIMED, Event.SUCCEEDED]


@pytest.mark.parametrize(
    ("kind", "counted", "expected"),
    [
        (ProblemKind.STORE_UNAVAILABLE, None, Event.ERROR),  # before a claim
        (ProblemKind.MISCONFIGURED, None, Event.REJECTED),  # an unstorable key: refused
        (ProblemKind.MISCONFIGURED, CLAIMED, Event.ERROR),  # claimed, its end not counted
        (ProblemKind.STORE_UNAVAILABLE, CLAIMED, Event.ERROR),
        (ProblemKind.MISCONFIGURED, RELEASED, None),  # counted by the mode already
        (ProblemKind.MISCONFIGURED, UNRESOLVED, None),
        (ProblemKind.STORE_UNAVAILABLE, UNRESOLVED, None),
    ],
)
def test_what_a_store_error_is_counted_as(
    kind: ProblemKind, counted: Event | None, expected: Event | None
) -> None:
    assert store_error_event(kind, counted) is expected
