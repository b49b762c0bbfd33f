"""A trigger or rule on the store's table that makes its write land nowhere (a BEFORE trigger
that returns NULL, a rule that does instead nothing): refused, 500 server-misconfigured, and
nothing of the request committed. On the fast path the record's INSERT went unchecked: the
handler's writes committed with no record, a 201 each time, and every retry ran again; on the
ordinary path and in lease mode the claim found neither its row nor another's and answered
"409, retry" for ever; a completion whose UPDATE matched nothing answered "503, retry" for ever."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import LeaseExpiry, Mode, Policy, PostgresStore, get_context
from tests.apps import client, key, one_route_app
from tests.integration.store_edges.lapsed import lapsed_record

_SETUPS = [(Mode.TRANSACTIONAL, True), (Mode.TRANSACTIONAL, False), (Mode.LEASE, True)]
_SWALLOWERS = {
    "insert-trigger": (
        "CREATE FUNCTION swallow() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END';"
        "CREATE TRIGGER swallow BEFORE INSERT ON idem_requests FOR EACH ROW EXECUTE FUNCTION "
        "swallow()"
    ),
    "insert-rule": "CREATE RULE swallow AS ON INSERT TO idem_requests DO INSTEAD NOTHING",
    "update-trigger": (
        "CREATE FUNCTION swallow() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END';"
        "CREATE TRIGGER swallow BEFORE UPDATE ON idem_requests FOR EACH ROW EXECUTE FUNCTION "
        "swallow()"
    ),
}
_UNDO = (
    "DROP RULE IF EXISTS swallow ON idem_requests; DROP TRIGGER IF EXISTS swallow ON "
    "idem_requests; DROP TABLE IF EXISTS swallow_ledger; DROP FUNCTION IF EXISTS swallow()"
)


async def pay(request: Request) -> Response:
    ctx = get_context(request)
    conn = ctx.connection if ctx.mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
    await conn.execute("INSERT INTO swallow_ledger VALUES ($1)", ctx.key)
    return JSONResponse({"paid": True}, status_code=201)


@pytest.fixture
async def admin(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(_UNDO + "; CREATE TABLE swallow_ledger (k text)")
        yield conn
    finally:
        await conn.execute(_UNDO)
        await conn.close()


async def _run_twice(
    db_dsn: str, admin: asyncpg.Connection, swallower: str, mode: Mode, fast_path: bool
) -> tuple[list[Response], int, int]:
    await admin.execute(_SWALLOWERS[swallower])
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    name = f"swallowed-{swallower}-{mode.value}-{fast_path}"
    async with (
        store,
        client(one_route_app("/pay", pay, store=store, default_policy=Policy(mode=mode))) as c,
    ):
        answers = [await c.post("/pay", json={}, headers=key(name)) for _ in range(2)]
    effects = await admin.fetchval("SELECT count(*) FROM swallow_ledger WHERE k = $1", name)
    records = await admin.fetchval("SELECT count(*) FROM idem_requests WHERE idem_key = $1", name)
    return answers, effects, records


@pytest.mark.parametrize("swallower", ["insert-trigger", "insert-rule"])
@pytest.mark.parametrize(("mode", "fast_path"), _SETUPS)
async def test_a_record_insert_that_lands_nowhere_is_refused(
    db_dsn: str, admin: asyncpg.Connection, swallower: str, mode: Mode, fast_path: bool
) -> None:
    answers, effects, records = await _run_twice(db_dsn, admin, swallower, mode, fast_path)
    for r in answers:
        assert r.status_code == 500, r.text
        assert r.json()["type"].endswith("server-misconfigured"), r.text
    assert (effects, records) == (0, 0)  # nothing committed, by any attempt


async def test_a_completion_update_that_lands_nowhere_is_refused_not_unavailable(
    db_dsn: str, admin: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The ordinary path writes the pending record at its claim and completes it by an UPDATE."""
    answers, effects, records = await _run_twice(
        db_dsn, admin, "update-trigger", Mode.TRANSACTIONAL, False
    )
    for r in answers:
        assert r.status_code == 500, r.text
        assert "retry-after" not in r.headers
    assert (effects, records) == (0, 0)
    assert "a trigger or rule on idem_requests" in caplog.text


@pytest.mark.parametrize(("mode", "fast_path"), [*_SETUPS, (Mode.LEASE, False)])
async def test_a_handlers_deferred_trigger_at_the_commit_is_named_as_the_handlers(
    db_dsn: str,
    admin: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
    mode: Mode,
    fast_path: bool,
) -> None:
    """A deferred trigger of the handler's table that fails at the COMMIT (it divides by zero:
    the fast path's checked record divides by zero too, when it wrote nothing, but leaves the
    transaction open): refused as the handler's, one run, not blamed on a trigger on
    idem_requests nor on a SET ROLE or search_path of the handler's."""
    await admin.execute(
        "CREATE FUNCTION swallow() RETURNS trigger LANGUAGE plpgsql AS"
        " 'BEGIN PERFORM 1 / 0; RETURN NULL; END';"
        "CREATE CONSTRAINT TRIGGER divide AFTER INSERT ON swallow_ledger"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION swallow()"
    )
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    app = one_route_app("/pay", pay, store=store, default_policy=Policy(mode=mode))
    async with store, client(app) as c:
        r = await c.post("/pay", json={}, headers=key(f"deferred-{mode.value}-{fast_path}"))
    assert r.status_code == 500, r.text
    assert "division by zero" in caplog.text
    assert "a deferred trigger or constraint of the handler's writes refused" in caplog.text
    assert "at its COMMIT" in caplog.text
    assert "a trigger or rule on idem_requests" not in caplog.text
    assert "no SET ROLE" not in caplog.text


async def _record(admin: asyncpg.Connection, name: str) -> tuple[str, int] | None:
    row = await admin.fetchrow(
        "SELECT state, generation FROM idem_requests WHERE idem_key = $1", name
    )
    return None if row is None else (row["state"], row["generation"])


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_lease_settlement_that_lands_nowhere_is_refused_not_stale(
    db_dsn: str, admin: asyncpg.Connection, fast_path: bool
) -> None:
    """Under the fence's own row lock a settlement that matched nothing was skipped by a trigger:
    refused, 500, on the unfused path too (it was taken for a stale executor's: "409, retry")."""
    answers, effects, records = await _run_twice(
        db_dsn, admin, "update-trigger", Mode.LEASE, fast_path
    )
    assert answers[0].status_code == 500, answers[0].text
    assert answers[0].json()["type"].endswith("server-misconfigured")
    assert (effects, records) == (0, 1)  # the fenced write rolled back; the record stays


@pytest.mark.parametrize(("mode", "fast_path"), _SETUPS)
async def test_an_expired_records_takeover_that_lands_nowhere_is_refused(
    db_dsn: str, admin: asyncpg.Connection, mode: Mode, fast_path: bool
) -> None:
    """A key reused after its retention: the claim's UPDATE of the expired record, skipped by a
    trigger, was taken for another claim's race, "409, retry" for ever."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    name = f"expired-swallowed-{mode.value}-{fast_path}"
    app = one_route_app("/pay", pay, store=store, default_policy=Policy(mode=mode))
    async with store, client(app) as c:
        assert (await c.post("/pay", json={}, headers=key(name))).status_code == 201
        await admin.execute(
            "UPDATE idem_requests SET expires_at = now() - interval '1 second' WHERE idem_key = $1",
            name,
        )
        await admin.execute(_SWALLOWERS["update-trigger"])
        again = await c.post("/pay", json={}, headers=key(name))
    assert again.status_code == 500, again.text
    assert again.json()["type"].endswith("server-misconfigured")
    assert await admin.fetchval("SELECT count(*) FROM swallow_ledger WHERE k = $1", name) == 1


@pytest.mark.parametrize("expiry", [LeaseExpiry.UNKNOWN, LeaseExpiry.TAKEOVER])
async def test_a_lapsed_lease_whose_move_lands_nowhere_is_refused(
    db_dsn: str, admin: asyncpg.Connection, expiry: LeaseExpiry
) -> None:
    """A retry of a lapsed lease marks it unknown or takes it over: skipped by a trigger, the
    record read back the same, it read and moved again to the end of the wait (thousands of
    round trips, a takeover drawing a generation each), then the app's bare 500."""
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    name = f"lapsed-swallowed-{expiry.value}"
    policy = Policy(mode=Mode.LEASE, on_lease_expiry=expiry)
    async with store, client(one_route_app("/pay", pay, store=store, default_policy=policy)) as c:
        await lapsed_record(c, store, admin, name)
        before = await _record(admin, name)
        await admin.execute(_SWALLOWERS["update-trigger"])
        drawn = await admin.fetchval("SELECT last_value FROM idem_generation_seq")
        r = await c.post("/pay", json={}, headers=key(name))
        drawn_after = await admin.fetchval("SELECT last_value FROM idem_generation_seq")
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert await _record(admin, name) == before  # (pending, its generation)
    assert drawn_after - drawn < 10  # a few moves, not one per round of the wait
