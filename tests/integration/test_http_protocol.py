"""What a request is and what a duplicate gets (docs/protocol.md), over HTTP, on PostgreSQL.

Every test checks the answer (status, headers, body) and the database effect: the ledger rows
and balances the credit handler writes on the claim's transaction, and the idempotency records.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from idem_middleware import KILL_SWITCH_ENV, Policy
from idem_middleware.store.postgres import decode_headers
from tests.apps import (
    BOUND,
    PROBLEM_BASE,
    CountingStore,
    Held,
    asgi_request,
    assert_problem,
    assert_replay_of,
    balance,
    build_app,
    client,
    count,
    key,
    records,
    wait_entered,
    wait_for_waiters,
)

pytestmark = pytest.mark.db_routes("pgbouncer")

CREDIT = "/accounts/acc1/credits"
CREDIT_OP = "POST /accounts/{account_id}/credits"
BODY = {"amount": 5, "memo": "x"}


def credited(call: int = 1, amount: int = 5, bal: int = 5, account: str = "acc1") -> dict[str, Any]:
    """The credit handler's 201 body."""
    return {"account_id": account, "amount": amount, "balance": bal, "call": call}


async def assert_effects(pool: Any, *, ledger: int, bal: int | None, recs: int) -> None:
    assert await count(pool, "test_ledger") == ledger
    assert await balance(pool, "acc1") == bal
    assert await count(pool, "idem_requests") == recs


# -- §3: absent ---------------------------------------------------------------------------------


async def test_absent_key_is_claimed_and_the_handler_runs_once(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        r = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert r.status_code == 201
    assert r.json() == credited()
    assert r.headers["location"] == "/accounts/acc1"
    assert "idempotent-replayed" not in r.headers
    assert app.state.probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)
    [rec] = await records(pool)
    assert (rec["tenant"], rec["operation"], rec["idem_key"]) == ("tenant-a", CREDIT_OP, "k1")
    assert (rec["state"], rec["mode"]) == ("succeeded", "transactional")
    assert rec["response_status"] == 201
    assert rec["response_body"] == r.content
    assert rec["expires_at"] is not None


# -- §3: succeeded -------------------------------------------------------------------------------


async def test_succeeded_same_fingerprint_replays_status_headers_and_body(pg_store, pool):
    app = build_app(pg_store)
    url = CREDIT + "?headers=extra"
    async with client(app) as c:
        first = await c.post(url, json=BODY, headers=key("k1"))
        replay = await c.post(url, json=BODY, headers=key("k1"))
    # The original client gets every header the handler set.
    assert first.status_code == 201
    assert first.headers["set-cookie"] == "s=1"
    assert first.headers["date"] == "Tue, 01 Jul 2025 12:00:00 GMT"
    assert first.headers["server"] == "test-server"
    # The replay: 201 (not 200), the same bytes, Location and the handler's own headers kept.
    assert_replay_of(replay, first)
    assert replay.status_code == 201
    assert replay.json() == credited(call=1)
    assert replay.headers["location"] == "/accounts/acc1"
    assert replay.headers["content-type"] == "application/json"
    assert replay.headers["cache-control"] == "no-store"
    assert replay.headers["x-request-note"] == "kept"
    for dropped in ("set-cookie", "date", "server"):
        assert dropped not in replay.headers
    assert len(replay.headers.get_list("content-length")) == 1
    # Storage never held them, and never held a Content-Length (recomputed on replay).
    [rec] = await records(pool)
    stored = {name for name, _ in decode_headers(rec["response_headers"])}
    assert {b"location", b"content-type", b"cache-control", b"x-request-note"} <= stored
    assert not stored & {b"set-cookie", b"date", b"server", b"content-length"}
    assert app.state.probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_succeeded_different_fingerprint_is_422_key_reused(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        [before] = await records(pool)
        other = await c.post(CREDIT, json={"amount": 6, "memo": "x"}, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)
    assert await records(pool) == [before]


# -- §3: pending ---------------------------------------------------------------------------------


async def test_in_flight_duplicate_with_short_wait_gets_409_with_retry_after(pg_store, pool):
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2, retry_after_seconds=3))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        dup = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("k1")), BOUND)
        assert not first.done()
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        later = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert_problem(dup, 409, "request-in-flight")
    assert dup.headers["retry-after"] == "3"
    assert r1.status_code == 201
    assert r1.json() == credited()
    assert_replay_of(later, r1)
    assert probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_in_flight_duplicate_waits_and_gets_the_replay_once_the_first_commits(pg_store, pool):
    app = build_app(pg_store, default_policy=Policy(wait_seconds=10))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        dup = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_for_waiters(app, 1)
        assert not dup.done()
        held.release()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, dup), BOUND)
    assert r1.status_code == 201
    assert_replay_of(r2, r1)
    assert probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_in_flight_different_body_is_422_only_once_the_first_commits(pg_store, pool):
    """Transactional mode: the claim is uncommitted while the handler runs, so a concurrent
    request cannot read its fingerprint. It waits (holding no connection) and learns the
    fingerprint (and so that the key was reused) only after the COMMIT: then 422, not earlier."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=10))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        other = held.start(c.post(CREDIT, json={"amount": 7}, headers=key("k1")))
        await wait_for_waiters(app, 1)
        assert not other.done()
        held.release()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, other), BOUND)
    assert r1.status_code == 201
    assert r1.json() == credited()
    assert_problem(r2, 422, "key-reused")
    assert probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_in_flight_duplicate_gets_202_with_location_when_the_policy_says_so(pg_store, pool):
    app = build_app(
        pg_store,
        default_policy=Policy(wait_seconds=0.2, retry_after_seconds=2, accept_while_in_flight=True),
    )
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        accepted = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("k1")), BOUND)
        assert not first.done()
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        status = await c.get(accepted.headers["location"])
    assert accepted.status_code == 202
    assert accepted.headers["retry-after"] == "2"
    # A state of the moment, as the status resource's answers: no cache may keep it (was: no
    # Cache-Control at all).
    assert accepted.headers.get_list("cache-control") == ["no-store"]
    assert "idempotent-replayed" not in accepted.headers
    location = httpx.URL(accepted.headers["location"])
    assert location.path == "/idempotency/status"
    params = dict(location.params)
    assert re.fullmatch("[0-9a-f]{24}", params.pop("request"))  # (a digest of this request)
    assert params == {"operation": CREDIT_OP, "key": "k1"}
    assert r1.status_code == 201
    # Once the original has committed, the status resource reports its outcome.
    assert status.status_code == 200
    assert status.json() == {
        "operation": CREDIT_OP,
        "state": "succeeded",
        "response_status": 201,
        "retry": False,
        "detail": "The request has finished: send it again with the same key for its response.",
    }
    assert probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_the_202_location_carries_the_apps_root_path(pg_store, pool):
    """An app served under a prefix (a proxy's `--root-path /api`): the Location must point
    inside it, or the client polls a path that is not this app's."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2, accept_while_in_flight=True))
    probe = app.state.probe
    prefixed = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, root_path="/api", raise_app_exceptions=False),
        base_url="http://test",
        headers={"authorization": "Bearer demo-a"},
    )
    async with prefixed as c, Held(probe) as held:
        first = held.start(c.post("/api" + CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        accepted = await asyncio.wait_for(
            c.post("/api" + CREDIT, json=BODY, headers=key("k1")), BOUND
        )
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        status = await c.get(accepted.headers["location"])
    assert (accepted.status_code, r1.status_code) == (202, 201)
    assert httpx.URL(accepted.headers["location"]).path == "/api/idempotency/status"
    assert status.status_code == 200, status.text
    assert status.json()["state"] == "succeeded"


@pytest.mark.parametrize(
    "root_path",
    ["/shop/a\r\nX-Injected: 1", "/shop/\u6771", "/shop/a b?c#d%"],
    ids=["crlf", "not-latin-1", "query-and-fragment-characters"],
)
async def test_the_202_location_percent_encodes_the_root_path(pg_store, pool, root_path):
    """Found by probing: the scope's root path is decoded (a mount's parameter, say), and went
    into the Location raw: a line break in a header, a 500 for a character latin-1 lacks, or a
    URL whose `?` cut the path short."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2, accept_while_in_flight=True))
    probe = app.state.probe
    prefixed = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, root_path=root_path, raise_app_exceptions=False),
        base_url="http://test",
        headers={"authorization": "Bearer demo-a"},
    )
    path = "http://test" + quote(root_path + CREDIT, safe="/")
    async with prefixed as c, Held(probe) as held:
        first = held.start(c.post(path, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        accepted = await asyncio.wait_for(c.post(path, json=BODY, headers=key("k1")), BOUND)
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        status = await c.get(accepted.headers["location"])
    assert (accepted.status_code, r1.status_code) == (202, 201)
    raw = accepted.headers.raw
    [location] = [value for name, value in raw if name.lower() == b"location"]
    assert location.isascii()
    assert b"\r" not in location
    assert b"\n" not in location
    assert httpx.URL(location.decode()).path == root_path + "/idempotency/status"
    assert status.status_code == 200, status.text


async def test_status_resource_of_a_202_reports_the_running_request_then_its_outcome(
    pg_store, pool
):
    """The status resource reads the caller's own record, or, while a transactional claim has
    not committed, that the key's claim lock is held (read from pg_locks, never taken): the
    running request is `pending`, with Retry-After; then the outcome."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2, accept_while_in_flight=True))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        accepted = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("k1")), BOUND)
        running = await c.get(accepted.headers["location"])
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
        done = await c.get(accepted.headers["location"])
    assert (accepted.status_code, r1.status_code) == (202, 201)
    assert (running.status_code, running.json()["state"]) == (200, "pending")
    assert running.headers["retry-after"] == "1"
    assert done.json()["state"] == "succeeded"


async def test_committed_pending_record_is_409_with_retry_after(pg_store, pool):
    """A pending record another process committed (a lease-mode claim, still leased) is in
    flight: 409 + Retry-After at once, and the handler does not run."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.2, retry_after_seconds=4))
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        await set_state(pool, "pending", lease="now() + interval '1 minute'")
        dup = await c.post(CREDIT, json=BODY, headers=key("k1"))
        other = await c.post(CREDIT, json={"amount": 9}, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(dup, 409, "request-in-flight")
    assert dup.headers["retry-after"] == "4"
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


# -- §3: failed_final ----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [402, 410])
async def test_failed_final_status_is_stored_and_replayed(pg_store, pool, status):
    app = build_app(pg_store)
    url = f"{CREDIT}?respond={status}"
    async with client(app) as c:
        first = await c.post(url, json=BODY, headers=key("k1"))
        replay = await c.post(url, json=BODY, headers=key("k1"))
    assert first.status_code == status
    assert first.json() == credited()
    assert_replay_of(replay, first)
    assert app.state.probe.calls == 1
    [rec] = await records(pool)
    assert (rec["state"], rec["response_status"]) == ("failed_final", status)
    # One transaction: what the handler wrote commits together with its final outcome.
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_declared_final_503_is_stored_and_replayed_without_running_again(pg_store, pool):
    app = build_app(pg_store)
    url = f"{CREDIT}?respond=declare-final"
    async with client(app) as c:
        first = await c.post(url, json=BODY, headers=key("k1"))
        replay = await c.post(url, json=BODY, headers=key("k1"))
    assert first.status_code == 503
    assert first.json() == {"error": "declined"}
    assert_replay_of(replay, first)
    assert app.state.probe.calls == 1
    [rec] = await records(pool)
    assert (rec["state"], rec["response_status"]) == ("failed_final", 503)
    await assert_effects(pool, ledger=1, bal=5, recs=1)


# -- §4 release statuses: not stored, the first attempt's writes rolled back ---------------------

RELEASE_STATUSES = [400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429]


@pytest.mark.parametrize("status", RELEASE_STATUSES)
async def test_release_status_is_not_stored_and_a_retry_runs_again(pg_store, pool, status):
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(f"{CREDIT}?respond={status}", json=BODY, headers=key("k1"))
        await assert_effects(pool, ledger=0, bal=None, recs=0)
        retry = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert first.status_code == status
    assert "idempotent-replayed" not in first.headers
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    # The retry ran (call 2) on a clean slate: the balance is 5, not 10.
    assert retry.json() == credited(call=2)
    assert app.state.probe.calls == 2
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_declared_release_on_a_201_releases_the_key(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(f"{CREDIT}?respond=declare-release", json=BODY, headers=key("k1"))
        await assert_effects(pool, ledger=0, bal=None, recs=0)
        retry = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert first.status_code == 201
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert retry.json() == credited(call=2)
    await assert_effects(pool, ledger=1, bal=5, recs=1)


# -- §3: unknown ---------------------------------------------------------------------------------


async def set_state(pool: Any, state: str, lease: str = "NULL") -> None:
    """Turn the one (completed) record into an unresolved lease-mode record, as a lease-mode
    claim in another process would have left it (same tenant, operation, key, fingerprint)."""
    status = await pool.execute(
        f"UPDATE idem_requests SET state = $1, mode = 'lease', expires_at = NULL, "
        f"lease_expires_at = {lease}, response_status = NULL, response_headers = NULL, "
        f"response_body = NULL, body_omitted = NULL",
        state,
    )
    assert status == "UPDATE 1"


async def test_unknown_outcome_is_409_and_never_runs_the_handler(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        await set_state(pool, "unknown")
        same = await c.post(CREDIT, json=BODY, headers=key("k1"))
        again = await c.post(CREDIT, json=BODY, headers=key("k1"))
        other = await c.post(CREDIT, json={"amount": 9}, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(same, 409, "outcome-unknown")
    assert_problem(again, 409, "outcome-unknown")
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)
    [rec] = await records(pool)
    assert rec["state"] == "unknown"


# -- §1: the key -----------------------------------------------------------------------------------


async def test_missing_key_is_400_and_nothing_is_claimed(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        r = await c.post(CREDIT, json=BODY)
    assert_problem(r, 400, "missing-key")
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([("idempotency-key", b"")], id="empty"),
        pytest.param([("idempotency-key", b'""')], id="empty-sf-string"),
        pytest.param([("idempotency-key", b"a" * 256)], id="256-chars"),
        pytest.param([("idempotency-key", b'"' + b"a" * 256 + b'"')], id="256-chars-quoted"),
        pytest.param([("idempotency-key", b"a\x01b")], id="control-char"),
        pytest.param([("idempotency-key", b"a\tb")], id="tab"),
        pytest.param([("idempotency-key", "clé".encode())], id="non-ascii"),
        pytest.param([("idempotency-key", b"a"), ("idempotency-key", b"a")], id="sent-twice"),
    ],
)
async def test_invalid_key_is_400_and_nothing_is_claimed(pg_store, pool, headers):
    app = build_app(pg_store)
    async with client(app) as c:
        r = await c.post(CREDIT, json=BODY, headers=headers)
    assert_problem(r, 400, "invalid-key")
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


async def test_key_of_255_chars_is_accepted(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        r = await c.post(CREDIT, json=BODY, headers=key("a" * 255))
    assert r.status_code == 201
    [rec] = await records(pool)
    assert rec["idem_key"] == "a" * 255
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_quoted_and_bare_key_are_the_same_key(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        quoted = await c.post(CREDIT, json=BODY, headers=key('"k1"'))
        bare = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert quoted.status_code == 201
    assert_replay_of(bare, quoted)
    [rec] = await records(pool)
    assert rec["idem_key"] == "k1"
    await assert_effects(pool, ledger=1, bal=5, recs=1)


# -- §1: the tenant --------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "not-a-token"])
async def test_unauthenticated_is_401_and_nothing_is_claimed(pg_store, pool, token):
    app = build_app(pg_store)
    async with client(app, token) as c:
        r = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert_problem(r, 401, "unauthenticated")
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


async def test_allow_anonymous_policy_accepts_no_token(pg_store, pool):
    app = build_app(pg_store, default_policy=Policy(allow_anonymous=True))
    async with client(app, None) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        replay = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert first.status_code == 201
    assert_replay_of(replay, first)
    [rec] = await records(pool)
    assert (rec["tenant"], rec["state"]) == ("", "succeeded")
    assert await balance(pool, "acc1", tenant="") == 5
    assert await count(pool, "test_ledger") == 1


async def test_key_optional_without_a_key_runs_unprotected_every_time(pg_store, pool):
    store = CountingStore(pg_store)
    app = build_app(store, default_policy=Policy(key_required=False), pool=pool)
    async with client(app) as c:
        r1 = await c.post(CREDIT, json=BODY)
        r2 = await c.post(CREDIT, json=BODY)
    assert (r1.status_code, r2.status_code) == (201, 201)
    assert r2.json() == credited(call=2, bal=10)
    assert "idempotent-replayed" not in r2.headers
    assert store.calls == 0
    await assert_effects(pool, ledger=2, bal=10, recs=0)


async def test_key_optional_with_a_key_is_still_guarded(pg_store, pool):
    app = build_app(pg_store, default_policy=Policy(key_required=False), pool=pool)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        replay = await c.post(CREDIT, json=BODY, headers=key("k1"))
        invalid = await c.post(CREDIT, json=BODY, headers=key("a" * 256))
    assert_replay_of(replay, first)
    # An optional key that is sent must still be valid: never silently unprotected.
    assert_problem(invalid, 400, "invalid-key")
    assert app.state.probe.calls == 1
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_tenants_are_isolated_with_the_same_key(pg_store, pool):
    app = build_app(pg_store)
    async with client(app, "demo-a") as a, client(app, "demo-b") as b:
        ra = await a.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        rb = await b.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        rb_again = await b.post(CREDIT, json={"amount": 5}, headers=key("k1"))
    assert ra.json() == credited(call=1)
    assert rb.status_code == 201
    assert "idempotent-replayed" not in rb.headers
    assert rb.json() == credited(call=2)  # its own execution, not tenant-a's body
    assert_replay_of(rb_again, rb)
    assert app.state.probe.calls == 2
    assert [r["tenant"] for r in await records(pool)] == ["tenant-a", "tenant-b"]
    assert await balance(pool, "acc1", "tenant-a") == 5
    assert await balance(pool, "acc1", "tenant-b") == 5
    assert await count(pool, "test_ledger") == 2


# -- §1: the operation ---------------------------------------------------------------------------


async def test_same_key_on_two_routes_is_two_operations(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        item = await c.post("/items", json=BODY, headers=key("k1"))
        cred = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert item.json() == {"item": "x", "call": 1}
    assert cred.status_code == 201
    assert "idempotent-replayed" not in cred.headers
    assert cred.json() == credited(call=2)
    assert sorted(r["operation"] for r in await records(pool)) == [CREDIT_OP, "POST /items"]
    assert await count(pool, "test_ledger") == 1


async def test_same_key_on_another_account_is_key_reused(pg_store, pool):
    """The operation is the route template, so /accounts/a1 and /accounts/a2 share a key space;
    the path parameters are in the fingerprint, so the second is a reused key, not a new credit."""
    app = build_app(pg_store)
    async with client(app) as c:
        a1 = await c.post("/accounts/a1/credits", json=BODY, headers=key("k1"))
        a2 = await c.post("/accounts/a2/credits", json=BODY, headers=key("k1"))
    assert a1.json() == credited(account="a1")
    assert_problem(a2, 422, "key-reused")
    assert app.state.probe.calls == 1
    assert await balance(pool, "a1") == 5
    assert await balance(pool, "a2") is None
    [rec] = await records(pool)
    assert rec["operation"] == CREDIT_OP


async def test_mounted_route_operation_is_the_full_template(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post("/v2/items/abc", json=BODY, headers=key("k1"))
        replay = await c.post("/v2/items/abc", json=BODY, headers=key("k1"))
        other = await c.post("/v2/items/def", json=BODY, headers=key("k1"))
    assert first.status_code == 201
    assert_replay_of(replay, first)
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1
    [rec] = await records(pool)
    assert rec["operation"] == "POST /v2/items/{item_id}"


async def test_explicit_policy_for_a_mounted_route_is_keyed_by_the_full_template(pg_store, pool):
    store = CountingStore(pg_store)
    app = build_app(store, policies={"POST /v2/items/{item_id}": Policy(guard=False)})
    async with client(app) as c:
        r1 = await c.post("/v2/items/abc", json=BODY, headers=key("k1"))
        r2 = await c.post("/v2/items/abc", json=BODY, headers=key("k1"))
    assert (r1.json()["call"], r2.json()["call"]) == (1, 2)
    assert "idempotent-replayed" not in r2.headers
    assert store.calls == 0
    assert await count(pool, "idem_requests") == 0


# -- §1: the fingerprint -------------------------------------------------------------------------


async def test_equivalent_json_is_the_same_request(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(
            CREDIT,
            content=b'{"amount":5,"memo":"x"}',
            headers={**key("k1"), "content-type": "application/json"},
        )
        replay = await c.post(
            CREDIT,
            content=b'{ "memo": "x", "amount": 5.0 }',
            headers={**key("k1"), "content-type": "application/json"},
        )
    assert first.status_code == 201
    assert_replay_of(replay, first)
    await assert_effects(pool, ledger=1, bal=5, recs=1)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{"amount": 5, "amount": 6}', id="duplicate-member"),
        pytest.param(b'{"amount": 5', id="truncated"),
        pytest.param(b"amount=5", id="not-json"),
    ],
)
async def test_invalid_json_body_is_400_and_nothing_is_claimed(pg_store, pool, content):
    app = build_app(pg_store)
    async with client(app) as c:
        r = await c.post(
            CREDIT, content=content, headers={**key("k1"), "content-type": "application/json"}
        )
    assert_problem(r, 400, "body-invalid")
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


def padded_body(size: int) -> bytes:
    """A JSON credit body of exactly `size` bytes."""
    head = b'{"amount":5,"memo":"'
    return head + b"m" * (size - len(head) - 2) + b'"}'


async def chunks_of(body: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_over_the_cap_is_413_and_nothing_is_claimed(pg_store, pool, chunked):
    app = build_app(pg_store, default_policy=Policy(max_body_bytes=64))
    body = padded_body(65)
    headers = {**key("k1"), "content-type": "application/json"}
    async with client(app) as c:
        content: Any = chunks_of(body, 20) if chunked else body
        request = c.build_request("POST", CREDIT, content=content, headers=headers)
        assert ("content-length" in request.headers) is not chunked
        r = await c.send(request)
    assert_problem(r, 413, "body-too-large")
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


async def test_non_numeric_content_length_is_400_and_nothing_is_claimed(pg_store, pool):
    app = build_app(pg_store)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"amount": 5}', "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = asgi_request(CREDIT, "k1", 13)
    scope["headers"] = [(n, b"13x" if n == b"content-length" else v) for n, v in scope["headers"]]
    await asyncio.wait_for(app(scope, receive, send), BOUND)
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["type"] == PROBLEM_BASE + "body-invalid"
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


async def test_declared_length_over_the_cap_is_413_before_reading_the_body(pg_store, pool):
    """A Content-Length over the cap is refused from the header alone: no body is read."""
    app = build_app(pg_store, default_policy=Policy(max_body_bytes=64))
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 10, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = asgi_request(CREDIT, "k1", 10_000_000)
    await asyncio.wait_for(app(scope, receive, send), BOUND)
    assert reads == 0
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["type"] == PROBLEM_BASE + "body-too-large"
    assert app.state.probe.calls == 0
    await assert_effects(pool, ledger=0, bal=None, recs=0)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_at_the_cap_is_accepted(pg_store, pool, chunked):
    app = build_app(pg_store, default_policy=Policy(max_body_bytes=64))
    body = padded_body(64)
    async with client(app) as c:
        content: Any = chunks_of(body, 20) if chunked else body
        r = await c.post(
            CREDIT, content=content, headers={**key("k1"), "content-type": "application/json"}
        )
    assert r.status_code == 201
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_excluded_fields_do_not_affect_the_fingerprint(pg_store, pool):
    app = build_app(pg_store, default_policy=Policy(exclude_fields=("trace_id",)))
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 5, "trace_id": "t1"}, headers=key("k1"))
        replay = await c.post(CREDIT, json={"amount": 5, "trace_id": "t2"}, headers=key("k1"))
        other = await c.post(CREDIT, json={"amount": 6, "trace_id": "t1"}, headers=key("k1"))
    assert first.status_code == 201
    assert_replay_of(replay, first)
    assert_problem(other, 422, "key-reused")
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_included_headers_are_part_of_the_fingerprint(pg_store, pool):
    app = build_app(pg_store, default_policy=Policy(include_headers=("X-Api-Version",)))
    async with client(app) as c:
        v1 = await c.post(CREDIT, json=BODY, headers={**key("k1"), "x-api-version": "1"})
        v1_again = await c.post(
            CREDIT, json=BODY, headers={**key("k1"), "x-api-version": "1", "x-other": "y"}
        )
        v2 = await c.post(CREDIT, json=BODY, headers={**key("k1"), "x-api-version": "2"})
    assert v1.status_code == 201
    assert_replay_of(v1_again, v1)
    assert_problem(v2, 422, "key-reused")
    await assert_effects(pool, ledger=1, bal=5, recs=1)


async def test_headers_not_included_do_not_affect_the_fingerprint(pg_store, pool):
    app = build_app(pg_store)
    async with client(app) as c:
        v1 = await c.post(CREDIT, json=BODY, headers={**key("k1"), "x-api-version": "1"})
        v2 = await c.post(CREDIT, json=BODY, headers={**key("k1"), "x-api-version": "2"})
    assert_replay_of(v2, v1)
    await assert_effects(pool, ledger=1, bal=5, recs=1)


# -- §1: what is not guarded ---------------------------------------------------------------------


async def test_get_and_put_without_a_policy_pass_through(pg_store, pool):
    store = CountingStore(pg_store)
    app = build_app(store)
    async with client(app) as c:
        got = await c.get("/accounts/acc1", headers=key("k1"))
        put1 = await c.put("/accounts/acc1", json=BODY, headers=key("k1"))
        put2 = await c.put("/accounts/acc1", json=BODY, headers=key("k1"))
        put_no_key = await c.put("/accounts/acc1", json=BODY)
    for r in (got, put1, put2, put_no_key):
        assert r.status_code == 200
        assert r.json() == {"ok": True}
        assert "idempotent-replayed" not in r.headers
    assert app.state.probe.calls == 4
    assert store.calls == 0
    assert await count(pool, "idem_requests") == 0


async def test_put_with_an_explicit_policy_is_guarded(pg_store, pool):
    app = build_app(pg_store, policies={"PUT /accounts/{account_id}": Policy()})
    async with client(app) as c:
        first = await c.put("/accounts/acc1", json=BODY, headers=key("k1"))
        replay = await c.put("/accounts/acc1", json=BODY, headers=key("k1"))
        missing = await c.put("/accounts/acc1", json=BODY)
    assert first.status_code == 200
    assert_replay_of(replay, first)
    assert_problem(missing, 400, "missing-key")
    assert app.state.probe.calls == 1
    [rec] = await records(pool)
    assert (rec["operation"], rec["state"]) == ("PUT /accounts/{account_id}", "succeeded")


@pytest.mark.parametrize(
    ("path", "status"),
    [("/no/such/route", 404), ("/accounts/acc1", 405)],
    ids=["unmatched", "method-not-allowed"],
)
async def test_unrouted_request_gets_the_apps_answer(pg_store, pool, path, status):
    store = CountingStore(pg_store)
    app = build_app(store)
    async with client(app) as c:
        r = await c.post(path, json=BODY, headers=key("k1"))
    assert r.status_code == status
    assert r.headers["content-type"] != "application/problem+json"
    assert store.calls == 0
    assert await count(pool, "idem_requests") == 0


async def test_not_idempotent_endpoint_passes_through(pg_store, pool):
    store = CountingStore(pg_store)
    app = build_app(store)
    async with client(app) as c:
        r1 = await c.post("/search", json=BODY, headers=key("k1"))
        r2 = await c.post("/search", json=BODY)
    assert r1.json() == {"results": [], "call": 1}
    assert r2.json() == {"results": [], "call": 2}
    assert store.calls == 0
    assert await count(pool, "idem_requests") == 0


async def assert_unguarded_credits(app: Any, store: CountingStore, pool: Any) -> None:
    """Two identical keyed credits both run, and the store is never asked anything."""
    async with client(app) as c:
        r1 = await c.post(CREDIT, json=BODY, headers=key("k1"))
        r2 = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert r1.json() == credited(call=1)
    assert r2.json() == credited(call=2, bal=10)
    assert "idempotent-replayed" not in r2.headers
    assert store.calls == 0
    await assert_effects(pool, ledger=2, bal=10, recs=0)


async def test_guard_false_policy_passes_through(pg_store, pool):
    store = CountingStore(pg_store)
    app = build_app(store, policies={CREDIT_OP: Policy(guard=False)}, pool=pool)
    await assert_unguarded_credits(app, store, pool)


async def test_kill_switch_argument_passes_through(pg_store, pool):
    store = CountingStore(pg_store)
    app = build_app(store, pool=pool, enabled=False)
    await assert_unguarded_credits(app, store, pool)


async def test_kill_switch_environment_variable_passes_through(pg_store, pool, monkeypatch):
    monkeypatch.setenv(KILL_SWITCH_ENV, "1")
    store = CountingStore(pg_store)
    app = build_app(store, pool=pool)
    await assert_unguarded_credits(app, store, pool)


async def test_replayed_204_has_no_content_length(pg_store, pool):
    """RFC 9110 §8.6: a 204 never carries Content-Length, and neither may its replay."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post("/no-content", json=BODY, headers=key("k1"))
        replay = await c.post("/no-content", json=BODY, headers=key("k1"))
    assert first.status_code == replay.status_code == 204
    assert "content-length" not in first.headers
    assert "content-length" not in replay.headers
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["x-done"] == "yes"
    assert replay.content == b""
    assert app.state.probe.calls == 1
    [rec] = await records(pool)
    assert (rec["state"], rec["response_status"]) == ("succeeded", 204)
