"""One-time tokens on the real store: consuming a token is the claim itself."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
import pytest

from idem_middleware import Mode, Policy, PostgresStore
from idem_middleware.context import token_hash
from idem_middleware.errors import StoreError
from idem_middleware.fingerprint import compute_fingerprint
from idem_middleware.tokens import TokenConflict, TokenIssuer, token_route
from tests.apps import assert_problem, build_app, client

pytestmark = pytest.mark.db_routes("pgbouncer")

SECRET = b"s" * 32
OP = "POST /accounts/{account_id}/credits"
URL = "/accounts/t1/credits"


@pytest.fixture
def issuer(pg_store: PostgresStore) -> TokenIssuer:
    return TokenIssuer(pg_store, secret=SECRET, ttl_seconds=600)


def token_app(store: Any, mode: Mode = Mode.TRANSACTIONAL, **options: Any) -> Any:
    return build_app(
        store,
        policies={OP: Policy(require_token=True, mode=mode, wait_seconds=5, **options)},
    )


async def ledger(pool: Any) -> int:
    count: int = await pool.fetchval("SELECT count(*) FROM test_ledger")
    return count


async def test_a_token_is_consumed_once_by_concurrent_requests(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    token = (await issuer.issue("tenant-a", OP)).token
    app = token_app(pg_store)
    async with client(app) as c:
        responses = await asyncio.gather(
            *(
                c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
                for _ in range(30)
            )
        )
    assert {r.status_code for r in responses} == {201}
    assert len({r.text for r in responses}) == 1
    assert sum("idempotent-replayed" in r.headers for r in responses) == 29
    assert app.state.probe.calls == 1
    assert await ledger(pool) == 1


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_forged_expired_other_tenant_and_other_operation_are_refused(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer, mode: Mode
) -> None:
    app = token_app(pg_store, mode)
    expired = (await issuer.issue("tenant-a", OP, ttl_seconds=0.001)).token
    for_b = (await issuer.issue("tenant-b", OP)).token
    other_op = (await issuer.issue("tenant-a", "POST /items")).token
    await asyncio.sleep(0.01)
    cases = {
        "it_forged": "not a token issued to you",
        expired: "expired",
        for_b: "not a token issued to you",  # another tenant's token is simply unknown
        other_op: "another operation",
    }
    async with client(app) as c:
        for key, detail in cases.items():
            r = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": key})
            assert r.status_code == 400, r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["type"] == "urn:idem-middleware:problem:token-invalid"
            assert detail in r.json()["detail"]
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0
    assert app.state.probe.calls == 0


async def test_a_token_bound_to_a_request_refuses_another_body(
    pg_store: PostgresStore, issuer: TokenIssuer
) -> None:
    from idem_middleware.fingerprint import compute_fingerprint

    digest = compute_fingerprint(
        operation=OP,
        path_params={"account_id": "t1"},
        query_string=b"",
        headers=[],
        include_headers=(),
        content_type=b"application/json",
        body=b'{"amount": 5}',
    )
    token = (await issuer.issue("tenant-a", OP, request_digest=digest)).token
    app = token_app(pg_store)
    async with client(app) as c:
        other = await c.post(URL, json={"amount": 6}, headers={"idempotency-key": token})
        same = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
    assert other.status_code == 400
    assert "different request" in other.json()["detail"]
    assert same.status_code == 201


async def test_consume_then_crash_is_answered_by_the_state_machine(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    """The token was consumed by a lease claim whose executor died: the retry is told the
    outcome is unknown (never "token already used"), and never runs twice."""
    token = (await issuer.issue("tenant-a", OP)).token
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention, lease_expires_at) VALUES ('tenant-a', $1, $2, $3, 'pending', 'lease', "
        "interval '1 day', now() - interval '1 second')",
        OP,
        token,
        digest(b'{"amount":5}'),
    )
    app = token_app(pg_store, Mode.LEASE)
    async with client(app) as c:
        r = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
    assert r.status_code == 409
    assert r.json()["type"] == "urn:idem-middleware:problem:outcome-unknown"
    assert app.state.probe.calls == 0


def digest(body: bytes) -> bytes:
    """The request digest a token bound to the credit route's request with `body` carries."""
    return compute_fingerprint(
        operation=OP,
        path_params={"account_id": "t1"},
        query_string=b"",
        headers=[],
        include_headers=(),
        content_type=b"application/json",
        body=body,
    )


async def test_a_replay_works_after_the_token_expired(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    token = (await issuer.issue("tenant-a", OP, ttl_seconds=60)).token
    app = token_app(pg_store)
    async with client(app) as c:
        first = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
        await pool.execute("UPDATE idem_tokens SET expires_at = now() - interval '1 second'")
        again = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"


async def test_issuance_is_idempotent_per_intent(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    one = await issuer.issue("tenant-a", OP, intent_id="checkout-42")
    two = await issuer.issue("tenant-a", OP, intent_id="checkout-42")
    other = await issuer.issue("tenant-a", OP, intent_id="checkout-43")
    random_one = await issuer.issue("tenant-a", OP)
    random_two = await issuer.issue("tenant-a", OP)
    assert one.token == two.token
    assert one.expires_at == two.expires_at
    assert other.token != one.token
    assert random_one.token != random_two.token
    assert len(one.token) >= 3 + 43  # 256 bits, base64url
    stored = {
        bytes(r["token_hash"]) for r in await pool.fetch("SELECT token_hash FROM idem_tokens")
    }
    assert token_hash(one.token) in stored
    assert all(one.token.encode() not in h for h in stored)  # only hashes are kept
    with pytest.raises(TokenConflict):
        await TokenIssuer(pg_store, secret=b"t" * 32).issue("tenant-a", OP, intent_id="checkout-42")


async def test_expired_tokens_are_purged(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    await issuer.issue("tenant-a", OP, ttl_seconds=0.001)
    await issuer.issue("tenant-a", OP, ttl_seconds=600)
    await asyncio.sleep(0.01)
    await pg_store.purge()
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 1


async def test_the_token_route(pg_store: PostgresStore, issuer: TokenIssuer) -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.authentication import AuthenticationMiddleware

    from tests.apps import BearerBackend

    app = Starlette(
        routes=[token_route(issuer)],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        body = {"operation": OP, "intent_id": "i-1"}
        auth = {"authorization": "Bearer demo-a"}
        first = await c.post("/idempotency/tokens", json=body, headers=auth)
        again = await c.post("/idempotency/tokens", json=body, headers=auth)
        anonymous = await c.post("/idempotency/tokens", json=body)
        bad = await c.post("/idempotency/tokens", content=b"[]", headers=auth)
    assert first.status_code == again.status_code == 201
    assert first.json()["token"] == again.json()["token"]
    # A one-time credential: no cache may keep it (was: no Cache-Control at all).
    assert first.headers["cache-control"] == "no-store"
    assert_problem(anonymous, 401, "unauthenticated")
    assert_problem(bad, 400, "body-invalid")


async def test_the_token_route_answers_a_conflict_with_a_problem(
    pg_store: PostgresStore, issuer: TokenIssuer
) -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.authentication import AuthenticationMiddleware

    from tests.apps import BearerBackend

    await issuer.issue("tenant-a", OP, intent_id="i-1")
    other = TokenIssuer(pg_store, secret=b"t" * 32)  # the same intent, under another secret
    app = Starlette(
        routes=[token_route(other)],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post(
            "/idempotency/tokens",
            json={"operation": OP, "intent_id": "i-1"},
            headers={"authorization": "Bearer demo-a"},
        )
    assert "another secret" in assert_problem(r, 409, "token-conflict")["detail"]


async def test_issuing_on_a_pool_that_is_gone_is_a_store_error(db_dsn: str) -> None:
    gone = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1)
    await gone.close()
    with pytest.raises(StoreError):
        await TokenIssuer(PostgresStore(pool=gone), secret=SECRET).issue("tenant-a", OP)
