"""One regression test per bug the peer libraries have that would apply to us (research/peers.md).

Peers: AIH asgi-idempotency-header, FI fastapi-idempotency, FIK fastapi-idempotency-key,
FID fastidempotent, KIT idempotency-kit, PYI pyidempotent, PT aws-lambda-powertools.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import Policy
from idem_middleware.store.postgres import decode_headers
from tests.apps import (
    BINARY_BODY,
    BOUND,
    Held,
    assert_problem,
    assert_replay_of,
    balance,
    build_app,
    cancel_while_held,
    client,
    count,
    key,
    records,
    wait_entered,
    wait_for_waiters,
)

pytestmark = pytest.mark.db_routes("pgbouncer")

CREDIT = "/accounts/acc1/credits"
BODY = {"amount": 5}


async def test_aih_raise_then_retry_is_not_stuck(pg_store, pool):
    """AIH (and PYI on Redis): a crash left the key claimed forever; every retry got 409."""
    app = build_app(pg_store)
    async with client(app) as c:
        crashed = await c.post(f"{CREDIT}?respond=raise", json=BODY, headers=key("k1"))
        retry = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert crashed.status_code == 500
    assert retry.status_code == 201
    assert retry.json()["call"] == 2
    assert await count(pool, "test_ledger") == 1
    assert [r["state"] for r in await records(pool)] == ["succeeded"]


async def test_fik_cancellation_does_not_leave_in_progress(pg_store, pool):
    """FIK, FID, PYI catch only Exception: a cancelled request left the record in progress."""
    app = build_app(pg_store)
    async with client(app) as c:
        await cancel_while_held(c, app.state.probe, CREDIT, json=BODY, headers=key("k1"))
        assert await count(pool, "idem_requests") == 0
        retry = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("k1")), BOUND)
    assert retry.status_code == 201
    assert retry.json()["call"] == 2
    assert await count(pool, "test_ledger") == 1


async def test_fik_redis_identical_retry_is_replayed_not_422(pg_store, pool):
    """FIK on Redis (and PT on Redis with validation) lost the fingerprint on completion, so
    every identical retry was a 422."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        retries = [await c.post(CREDIT, json=BODY, headers=key("k1")) for _ in range(3)]
    for retry in retries:
        assert_replay_of(retry, first)
    fingerprint = await pool.fetchval("SELECT fingerprint FROM idem_requests")
    assert len(fingerprint) == 32
    assert app.state.probe.calls == 1
    assert await count(pool, "test_ledger") == 1


async def test_decorator_peers_replay_201_not_200(pg_store, pool):
    """FIK and FID replayed a 201 as 200; FIK replayed a model as its repr string."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        replay = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert first.status_code == 201
    assert replay.status_code == 201
    assert (
        replay.json()
        == first.json()
        == {
            "account_id": "acc1",
            "amount": 5,
            "balance": 5,
            "call": 1,
        }
    )
    assert replay.headers["content-type"] == "application/json"
    [rec] = await records(pool)
    assert rec["response_status"] == 201


async def test_aih_different_body_is_422_not_original_replayed(pg_store, pool):
    """AIH (and PT without payload validation) replayed the original for a different body."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        other = await c.post(CREDIT, json={"amount": 500}, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert b"balance" not in other.content
    assert await balance(pool, "acc1") == 5


async def test_tenant_b_never_gets_tenant_a_body(pg_store, pool):
    """Six peers replayed tenant A's body to tenant B (FI keyed on the client IP, which both
    tenants share here)."""
    app = build_app(pg_store)
    async with client(app, "demo-a") as a, client(app, "demo-b") as b:
        ra = await a.post(CREDIT, json={"amount": 5}, headers=key("k1"))
        rb = await b.post(CREDIT, json={"amount": 5}, headers=key("k1"))
    assert ra.status_code == rb.status_code == 201
    assert "idempotent-replayed" not in rb.headers
    assert rb.content != ra.content
    assert rb.json()["call"] == 2
    assert await balance(pool, "acc1", "tenant-a") == 5
    assert await balance(pool, "acc1", "tenant-b") == 5


async def test_other_route_same_key_is_independent(pg_store, pool):
    """AIH and PYI replayed another route's response; FI and FIK answered 422."""
    app = build_app(pg_store)
    async with client(app) as c:
        item = await c.post("/items", json=BODY, headers=key("k1"))
        cred = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert item.json() == {"item": "x", "call": 1}
    assert cred.status_code == 201
    assert "idempotent-replayed" not in cred.headers
    assert cred.json()["account_id"] == "acc1"
    assert await count(pool, "test_ledger") == 1
    assert await count(pool, "idem_requests") == 2


async def test_fi_no_auto_dedup_without_key(pg_store, pool):
    """FI deduplicated identical keyless requests for 10 s (PT collapsed them too): two
    purchases of the same thing are two purchases."""
    app = build_app(pg_store, default_policy=Policy(key_required=False), pool=pool)
    async with client(app) as c:
        r1 = await c.post(CREDIT, json=BODY)
        r2 = await c.post(CREDIT, json=BODY)
    assert r1.json()["balance"] == 5
    assert r2.json()["balance"] == 10
    assert "idempotent-replayed" not in r2.headers
    assert await count(pool, "test_ledger") == 2
    assert await count(pool, "idem_requests") == 0


async def test_two_keys_same_body_are_two_operations(pg_store, pool):
    """The counterpart of auto-dedup: an identical body under a new key is a new operation."""
    app = build_app(pg_store)
    async with client(app) as c:
        r1 = await c.post(CREDIT, json=BODY, headers=key("k1"))
        r2 = await c.post(CREDIT, json=BODY, headers=key("k2"))
    assert (r1.json()["balance"], r2.json()["balance"]) == (5, 10)
    assert await count(pool, "test_ledger") == 2


async def test_aih_streaming_not_truncated_on_replay(pg_store, pool):
    """AIH replayed a streamed JSON response truncated (`{"a":`)."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post("/stream-json", json=BODY, headers=key("k1"))
        replay = await c.post("/stream-json", json=BODY, headers=key("k1"))
    assert first.json() == {"a": [1, 2, 3], "call": 1}
    assert_replay_of(replay, first)
    assert replay.json() == {"a": [1, 2, 3], "call": 1}
    assert app.state.probe.calls == 1
    [rec] = await records(pool)
    assert rec["response_body"] == first.content


async def test_aih_body_in_chunks_is_one_request(pg_store, pool):
    """AIH parsed JSON per body chunk; a body in pieces must be fingerprinted whole."""

    async def pieces():
        for piece in (b'{"amo', b'unt": ', b"5}"):
            yield piece

    app = build_app(pg_store)
    headers = {**key("k1"), "content-type": "application/json"}
    async with client(app) as c:
        first = await c.post(CREDIT, content=pieces(), headers=headers)
        replay = await c.post(CREDIT, content=b'{"amount":5}', headers=headers)
    assert first.json()["amount"] == 5
    assert_replay_of(replay, first)
    assert await count(pool, "test_ledger") == 1


async def test_raw_byte_fingerprints_reformatted_json_is_a_replay(pg_store, pool):
    """Every HTTP peer hashed the raw bytes: the same JSON written differently was a 422."""
    app = build_app(pg_store)
    headers = {**key("k1"), "content-type": "application/json"}
    async with client(app) as c:
        first = await c.post(CREDIT, content=b'{"amount":5,"memo":"x"}', headers=headers)
        replay = await c.post(
            CREDIT, content=b'{\n  "memo" : "\\u0078",\n  "amount" : 5e0\n}', headers=headers
        )
    assert_replay_of(replay, first)
    assert await count(pool, "test_ledger") == 1


async def test_fid_query_string_is_part_of_the_fingerprint(pg_store, pool):
    """FID left the query string out of its fingerprint."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post("/items?colour=red&size=2", json=BODY, headers=key("k1"))
        reordered = await c.post("/items?size=2&colour=red", json=BODY, headers=key("k1"))
        other = await c.post("/items?colour=blue&size=2", json=BODY, headers=key("k1"))
    assert first.status_code == 201
    assert_replay_of(reordered, first)
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1
    assert await count(pool, "idem_requests") == 1


async def test_pyi_non_json_result_is_replayed_byte_for_byte(pg_store, pool):
    """PYI failed to store a non-JSON result (500), then the claim was stuck for 24 h."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post("/binary", json=BODY, headers=key("k1"))
        replay = await c.post("/binary", json=BODY, headers=key("k1"))
    assert first.status_code == 201
    assert first.content == BINARY_BODY
    assert_replay_of(replay, first)
    assert replay.headers["content-type"] == "application/octet-stream"
    [rec] = await records(pool)
    assert rec["response_body"] == BINARY_BODY


async def test_aih_expired_key_claimable_again(pg_store, pool):
    """AIH answered 409 forever once the stored response's TTL had passed."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        [before] = await records(pool)
        await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        again = await c.post(CREDIT, json={"amount": 7}, headers=key("k1"))
    assert first.status_code == again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert again.json() == {"account_id": "acc1", "amount": 7, "balance": 12, "call": 2}
    [after] = await records(pool)
    assert after["state"] == "succeeded"
    assert after["generation"] > before["generation"]
    assert after["response_body"] == again.content
    assert await count(pool, "test_ledger") == 2


async def test_fid_read_then_lock_race(pg_store, pool):
    """FID on Redis read the record, then took a separate lock: two concurrent requests both
    ran. Here both arrive together and the claim alone decides."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=10))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        both = [held.start(c.post(CREDIT, json=BODY, headers=key("k1"))) for _ in range(2)]
        await wait_entered(probe)
        await wait_for_waiters(app, 1)
        held.release()
        r1, r2 = await asyncio.wait_for(asyncio.gather(*both), BOUND)
    assert r1.status_code == r2.status_code == 201
    assert r1.content == r2.content
    assert sorted(r.headers.get("idempotent-replayed", "") for r in (r1, r2)) == ["", "true"]
    assert probe.calls == 1
    assert await count(pool, "test_ledger") == 1


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_five_xx_not_finalised(pg_store, pool, status):
    """AIH and FID stored 5xx answers: the retry got the same 503 forever."""
    app = build_app(pg_store)
    async with client(app) as c:
        failed = await c.post(f"{CREDIT}?respond={status}", json=BODY, headers=key("k1"))
        assert await count(pool, "idem_requests") == 0
        retry = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert failed.status_code == status
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert await count(pool, "test_ledger") == 1
    assert [r["response_status"] for r in await records(pool)] == [201]


async def test_set_cookie_never_replayed(pg_store, pool):
    """FIK stored every header, Set-Cookie included, and handed it to whoever retried."""
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post(CREDIT, json=BODY, headers=key("k1"))
        replay = await c.post(CREDIT, json=BODY, headers=key("k1"))
    assert first.headers["set-cookie"] == "s=1"
    assert replay.headers["idempotent-replayed"] == "true"
    assert "set-cookie" not in replay.headers
    [rec] = await records(pool)
    stored: list[Any] = decode_headers(rec["response_headers"])
    assert all(name != b"set-cookie" for name, _ in stored)
    assert (b"location", b"/accounts/acc1") in stored


async def test_in_flight_409_carries_retry_after(pg_store, pool):
    """No peer sent Retry-After with its 409."""
    app = build_app(pg_store, default_policy=Policy(wait_seconds=0.1, retry_after_seconds=2))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        first = held.start(c.post(CREDIT, json=BODY, headers=key("k1")))
        await wait_entered(probe)
        dup = await asyncio.wait_for(c.post(CREDIT, json=BODY, headers=key("k1")), BOUND)
        held.release()
        r1 = await asyncio.wait_for(first, BOUND)
    assert_problem(dup, 409, "request-in-flight")
    assert dup.headers["retry-after"] == "2"
    assert r1.status_code == 201
    assert await count(pool, "test_ledger") == 1
