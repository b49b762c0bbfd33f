"""One-time tokens, hardened: digest binding on re-issue, concurrent first issues, the token
route under the middleware, and the route's validation of what it stores."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware

from idem_middleware import MemoryStore, Policy, PostgresStore
from idem_middleware.errors import StatementRefused, StoreError
from idem_middleware.tokens import TokenConflict, TokenIssuer, token_route
from tests.apps import (
    BOUND,
    BearerBackend,
    Held,
    assert_problem,
    build_app,
    client,
    key,
    wait_entered,
)
from tests.integration.test_tokens import OP, digest

SECRET = b"s" * 32

URL = "/accounts/t1/credits"
TOKENS = "/idempotency/tokens"
MAX_INTENT_ID = 255  # the documented longest intent_id
MAX_BODY = 1024 * 1024  # the documented largest body the route reads


@pytest.fixture
def issuer(pg_store: PostgresStore) -> TokenIssuer:
    return TokenIssuer(pg_store, secret=SECRET, ttl_seconds=600)


def route_only_app(issuer: TokenIssuer) -> Starlette:
    return Starlette(
        routes=[token_route(issuer)],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerBackend())],
    )


def route_client(app: Starlette) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"authorization": "Bearer demo-a"}
    )


# -- 1. a re-issue for another request digest, None included, is a conflict ----------------------


async def test_an_unbound_intent_is_not_handed_out_as_bound(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    five, six = digest(b'{"amount": 5}'), digest(b'{"amount": 6}')
    await issuer.issue("tenant-a", OP, intent_id="unbound")
    with pytest.raises(TokenConflict, match="different request"):
        await issuer.issue("tenant-a", OP, intent_id="unbound", request_digest=five)
    stored = await pool.fetchval(
        "SELECT request_digest FROM idem_tokens WHERE intent_id = 'unbound'"
    )
    assert stored is None
    # the other directions, as documented
    await issuer.issue("tenant-a", OP, intent_id="bound", request_digest=five)
    with pytest.raises(TokenConflict, match="different request"):
        await issuer.issue("tenant-a", OP, intent_id="bound")
    with pytest.raises(TokenConflict, match="different request"):
        await issuer.issue("tenant-a", OP, intent_id="bound", request_digest=six)
    # the same digest (or the same None) is the same token
    bound = await issuer.issue("tenant-a", OP, intent_id="bound", request_digest=five)
    again = await issuer.issue("tenant-a", OP, intent_id="bound", request_digest=five)
    assert bound.token == again.token
    unbound = await issuer.issue("tenant-a", OP, intent_id="unbound")
    assert unbound.token == (await issuer.issue("tenant-a", OP, intent_id="unbound")).token


# -- 2. concurrent first issues of one intent -----------------------------------------------------


async def test_concurrent_issues_of_one_intent_return_one_token(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    for round_ in range(30):
        results = await asyncio.gather(
            *(issuer.issue("tenant-a", OP, intent_id=f"race-{round_}") for _ in range(16)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == [], errors
        assert len({r.token for r in results if not isinstance(r, BaseException)}) == 1
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 30


class LosesTheRaceOnce:
    """Delegates to the real store, but the first issue raises what the loser of a concurrent
    first issue gets: a unique violation on the token's primary key."""

    def __init__(self, store: PostgresStore, error: str) -> None:
        self._store = store
        self._error = error
        self.calls = 0

    async def issue_token(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            await self._store.issue_token(*args, **kwargs)  # the winner's row
            raise StatementRefused(self._error)
        return await self._store.issue_token(*args, **kwargs)


async def test_issue_reads_again_after_losing_the_primary_key_race(
    pg_store: PostgresStore,
) -> None:
    store = LosesTheRaceOnce(
        pg_store,
        'UniqueViolationError: duplicate key value violates unique constraint "idem_tokens_pkey"',
    )
    issued = await TokenIssuer(store, secret=SECRET).issue("tenant-a", OP, intent_id="lost")
    assert store.calls == 2
    assert (
        issued.token
        == (
            await TokenIssuer(pg_store, secret=SECRET).issue("tenant-a", OP, intent_id="lost")
        ).token
    )
    # any other refusal is not retried
    other = LosesTheRaceOnce(pg_store, "CheckViolationError: no")
    with pytest.raises(StatementRefused):
        await TokenIssuer(other, secret=SECRET).issue("tenant-a", OP, intent_id="other")
    assert other.calls == 1


async def test_asking_again_for_an_intent_being_consumed_does_not_wait_for_its_request(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    """A transactional request consuming an intent's token holds the token's row until it
    commits. Asking again for that intent meanwhile (a second tab, a retried "give me a token")
    is answered from the token as last committed: it used to wait for that row inside
    PostgreSQL, a pooled connection held, for as long as the handler ran."""
    token = (await issuer.issue("tenant-a", OP, intent_id="held")).token
    app = build_app(pg_store, policies={OP: Policy(require_token=True, wait_seconds=5)})
    probe = app.state.probe
    probe.gate = asyncio.Event()
    async with client(app) as c:
        first = asyncio.create_task(
            c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
        )
        try:
            await wait_entered(probe)
            again = await asyncio.wait_for(issuer.issue("tenant-a", OP, intent_id="held"), BOUND)
            assert again.token == token
            assert not first.done()  # (answered while the request still held the token's row)
        finally:
            probe.gate.set()
        assert (await first).status_code == 201
    # Once consumed and committed it is still handed out while live, and never renewed.
    assert (await issuer.issue("tenant-a", OP, intent_id="held")).token == token
    await pool.execute("UPDATE idem_tokens SET expires_at = now() - interval '1 second'")
    with pytest.raises(TokenConflict, match="already used"):
        await issuer.issue("tenant-a", OP, intent_id="held")


# -- 3. the token route is never guarded by the middleware ----------------------------------------


@pytest.mark.parametrize("default", [Policy(), Policy(require_token=True)], ids=["key", "token"])
async def test_the_token_route_is_not_guarded_by_the_middleware(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer, default: Policy
) -> None:
    app = build_app(pg_store, default_policy=default, policies={OP: Policy(require_token=True)})
    app.router.routes.append(token_route(issuer))
    async with client(app) as c:
        first = await c.post(TOKENS, json={"operation": OP, "intent_id": "first"})
        again = await c.post(TOKENS, json={"operation": OP, "intent_id": "first"})
        assert first.status_code == again.status_code == 201, first.text
        assert first.json()["token"] == again.json()["token"]
        token = first.json()["token"]
        spent = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": token})
    assert spent.status_code == 201, spent.text
    assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 1  # only the credit


@pytest.mark.parametrize(
    ("operation", "why"),
    [
        ("POST /items", "takes no token"),  # guarded, with a key: any key does
        ("POST /nowhere", "is no guarded operation"),
        ("POST /accounts/t1/credits", "Did you mean 'POST /accounts/{account_id}/credits'?"),
        ("GET /accounts/{account_id}", "is no guarded operation"),  # never guarded
    ],
)
async def test_the_token_route_issues_only_for_operations_that_take_tokens(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer, operation: str, why: str
) -> None:
    """Found by probing: the route issued a token for any operation of the right shape, one
    that needs none, one that does not exist, or the request's path where its template was
    meant; the client learnt of it only when the token was refused as another operation's at
    its first use (or never, on a route that takes any key). Such an operation is now a 400
    that says which operations take tokens, and nothing is issued."""
    app = build_app(pg_store, policies={OP: Policy(require_token=True)})
    app.router.routes.append(token_route(issuer))
    async with client(app) as c:
        refused = await c.post(TOKENS, json={"operation": operation, "intent_id": "i"})
        issued = await c.post(TOKENS, json={"operation": OP, "intent_id": "i"})
    assert why in assert_problem(refused, 400, "body-invalid")["detail"]
    assert issued.status_code == 201, issued.text
    assert await pool.fetchval("SELECT array_agg(operation) FROM idem_tokens") == [OP]


async def test_a_token_route_where_nothing_takes_tokens_refuses_and_startup_says_so(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer, caplog: pytest.LogCaptureFixture
) -> None:
    app = build_app(pg_store)
    app.router.routes.append(token_route(issuer))
    async with client(app) as c:
        r = await c.post(TOKENS, json={"operation": OP})
    assert (
        "No operation of this server takes tokens"
        in assert_problem(r, 400, "body-invalid")["detail"]
    )
    assert any("no guarded operation has it" in m for m in caplog.messages)
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 0


async def test_a_202_keeps_the_token_out_of_its_location(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    """Found by probing: a duplicate in flight on a token route got a 202 whose Location named
    the token in its query, and every poll of it wrote the token into the server's access log
    (uvicorn's, at INFO) and any proxy's; a token a release gives back is live again. The
    Location now names the operation only, and the client sends the token in the
    Idempotency-Key header, as it sent the request."""
    policy = Policy(require_token=True, wait_seconds=0.2, accept_while_in_flight=True)
    app = build_app(pg_store, policies={OP: policy})
    app.router.routes.append(token_route(issuer))
    probe = app.state.probe
    async with client(app) as c, Held(probe) as held:
        token = (await c.post(TOKENS, json={"operation": OP})).json()["token"]
        first = held.start(c.post(URL, json={"amount": 5}, headers=key(token)))
        await wait_entered(probe)
        accepted = await asyncio.wait_for(
            c.post(URL, json={"amount": 5}, headers=key(token)), BOUND
        )
        held.release()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
        location = accepted.headers["location"]
        status = await c.get(location, headers=key(token))
        without = await c.get(location)
    assert accepted.status_code == 202
    assert token not in location
    assert token not in accepted.text
    params = dict(httpx.URL(location).params)
    assert re.fullmatch("[0-9a-f]{24}", params.pop("request"))  # (a digest of the request)
    assert params == {"operation": OP}
    assert status.json()["state"] == "succeeded", status.text
    assert "Idempotency-Key header" in assert_problem(without, 400, "missing-key")["detail"]


# -- 4. the route validates what it would store ---------------------------------------------------


async def test_the_token_route_refuses_strings_the_database_cannot_keep(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    bodies = [
        {"operation": "POST /x\u0000", "intent_id": "i"},
        {"operation": OP, "intent_id": "a\u0000b"},
        {"operation": OP, "intent_id": "x" * 100_000},
        {"operation": OP, "intent_id": "x" * (MAX_INTENT_ID + 1)},
        {"operation": "payouts"},
        {"operation": "post /payouts"},
        {"operation": ""},
    ]
    async with route_client(route_only_app(issuer)) as c:
        for body in bodies:
            assert_problem(await c.post(TOKENS, json=body), 400, "body-invalid")
        for raw in (b'{"operation": "POST /x", "intent_id": "\\ud800"}',):
            assert_problem(await c.post(TOKENS, content=raw), 400, "body-invalid")
        longest = await c.post(TOKENS, json={"operation": OP, "intent_id": "x" * MAX_INTENT_ID})
        host = await c.post(TOKENS, json={"operation": "POST api.example/x", "intent_id": "é"})
    assert longest.status_code == host.status_code == 201
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 2


async def test_the_token_route_refuses_a_member_given_twice() -> None:
    """Read as the guarded routes read bodies (I-JSON). Found by probing: orjson took the last
    `operation` of two, so a gateway reading the first authorised another operation than the
    one the token was issued for."""
    raw = f'{{"operation": "POST /other", "operation": "{OP}", "intent_id": "i"}}'.encode()
    async with route_client(route_only_app(TokenIssuer(MemoryStore(), secret=SECRET))) as c:
        refused = await c.post(TOKENS, content=raw)
        issued = await c.post(TOKENS, json={"operation": OP, "intent_id": "i"})
    assert "duplicate JSON object key" in assert_problem(refused, 400, "body-invalid")["detail"]
    assert issued.status_code == 201


class Refuses:
    async def issue_token(self, *args: Any, **kwargs: Any) -> Any:
        raise StatementRefused("CharacterNotInRepertoireError: invalid byte sequence")


async def test_a_refused_issue_is_a_bad_request_not_a_server_error() -> None:
    async with route_client(route_only_app(TokenIssuer(Refuses(), secret=SECRET))) as c:
        r = await c.post(TOKENS, json={"operation": OP, "intent_id": "i"})
    assert_problem(r, 400, "body-invalid")


class Unreachable:
    async def issue_token(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreError("no database connection: ConnectionRefusedError")


async def test_an_unreachable_store_is_a_503_to_retry_not_a_server_error() -> None:
    """Found by probing: the route let the store's error out, a bare `500 Internal Server
    Error` (text/plain), where the guarded routes answer `503 store-unavailable` + Retry-After."""
    async with route_client(route_only_app(TokenIssuer(Unreachable(), secret=SECRET))) as c:
        r = await c.post(TOKENS, json={"operation": OP, "intent_id": "i"})
    assert_problem(r, 503, "store-unavailable")
    assert r.headers["retry-after"] == "1"


async def test_the_token_route_reads_no_more_than_a_bounded_body(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    """Found by probing: the route (never guarded by the middleware, so no `max_body_bytes`)
    read a body of any size into memory before parsing it."""
    padding = "x" * MAX_BODY
    async with route_client(route_only_app(issuer)) as c:
        r = await c.post(TOKENS, json={"operation": OP, "padding": padding})
    assert_problem(r, 413, "body-too-large")
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 0


# -- the per-call time to live --------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1.0, math.nan, math.inf, -math.inf, 1e300, True, "60"])
async def test_issue_refuses_a_time_to_live_that_is_not_positive_and_finite(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer, ttl: float
) -> None:
    # (1e300 seconds: `now() + ttl` is out of PostgreSQL's range, and every issue was refused
    # with a StatementRefused, which the token route answered as a client's bad body)
    with pytest.raises(ValueError, match="ttl_seconds"):
        await issuer.issue("tenant-a", OP, ttl_seconds=ttl)
    with pytest.raises(ValueError, match="ttl_seconds"):
        TokenIssuer(pg_store, secret=SECRET, ttl_seconds=ttl)
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 0


# -- rotating the secret --------------------------------------------------------------------------


async def test_a_rotated_secret_still_hands_out_the_intents_issued_before_it(
    pg_store: PostgresStore, pool: Any, issuer: TokenIssuer
) -> None:
    """Found by probing: the secret could not be rotated with tokens in flight. A client whose
    response to "give me a token" was lost, asking again after the rotation, was refused (409
    "issued under another secret") for as long as its intent's token lived, and a used one's
    tombstone refused it for good. Listed in `previous_secrets`, the old secret's intents get
    their token back, and that token is consumed as any other."""
    before = await issuer.issue("tenant-a", OP, intent_id="i-1")
    new = b"n" * 32
    with pytest.raises(TokenConflict, match="another secret"):
        await TokenIssuer(pg_store, secret=new).issue("tenant-a", OP, intent_id="i-1")
    rotated = TokenIssuer(pg_store, secret=new, previous_secrets=[SECRET])
    again = await rotated.issue("tenant-a", OP, intent_id="i-1")
    fresh = await rotated.issue("tenant-a", OP, intent_id="i-2")
    assert again == before
    # A new intent's token is the new secret's.
    assert fresh == await TokenIssuer(pg_store, secret=new).issue("tenant-a", OP, intent_id="i-2")
    app = build_app(pg_store, policies={OP: Policy(require_token=True)})
    async with client(app) as c:
        used = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": again.token})
    assert used.status_code == 201
    assert (
        await pool.fetchval("SELECT count(*) FROM idem_tokens WHERE consumed_at IS NOT NULL") == 1
    )


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"secret": "s" * 32}, TypeError),  # an environment variable not encoded
        ({"secret": SECRET, "previous_secrets": [b"short"]}, ValueError),
        ({"secret": SECRET, "previous_secrets": SECRET}, TypeError),  # one secret, not a list
    ],
    ids=["str-secret", "short-previous", "previous-not-a-list"],
)
def test_a_secret_that_cannot_sign_is_refused_when_the_issuer_is_made(
    options: dict[str, Any], error: type[Exception]
) -> None:
    """Found by probing: a `str` secret was accepted, and failed each issue for an intent with
    a TypeError (a 500 from the token route) instead of failing where it is configured."""
    with pytest.raises(error):
        TokenIssuer(object(), **options)


def test_an_issuer_on_a_store_that_cannot_issue_is_refused_when_made() -> None:
    with pytest.raises(TypeError, match="issue_token"):
        TokenIssuer(object(), secret=SECRET)


async def test_the_memory_store_issues_tokens_as_the_real_one_does() -> None:
    """Found by probing: a TokenIssuer on the MemoryStore (an app's test setup) was accepted,
    and each issue failed with an AttributeError, a 500 from the token route. The twin now
    issues as queries.sql `issue_token` does: one token per intent, renewed while unused, never
    once used and expired, and kept through purge as a tombstone."""
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    issuer = TokenIssuer(store, secret=SECRET, ttl_seconds=60)
    first = await issuer.issue("tenant-a", OP, intent_id="i-1")
    assert await issuer.issue("tenant-a", OP, intent_id="i-1") == first
    now[0] += 120  # expired unused: renewed, the same token
    renewed = await issuer.issue("tenant-a", OP, intent_id="i-1")
    assert (renewed.token, renewed.expires_at > first.expires_at) == (first.token, True)
    with pytest.raises(TokenConflict, match="different request"):
        await issuer.issue("tenant-a", OP, intent_id="i-1", request_digest=b"d" * 32)
    app = build_app(store, policies={OP: Policy(require_token=True)})
    async with client(app) as c:
        used = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": first.token})
        assert used.status_code == 201
        assert await issuer.issue("tenant-a", OP, intent_id="i-1") == renewed  # live: handed out
        now[0] += 120
        await store.purge()
        with pytest.raises(TokenConflict, match="already used"):
            await issuer.issue("tenant-a", OP, intent_id="i-1")  # the tombstone
        replay = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": first.token})
        now[0] += 2 * 86400  # past the record's retention, and purged: the token stays used
        await store.purge()
        again = await c.post(URL, json={"amount": 5}, headers={"idempotency-key": first.token})
    assert replay.headers["idempotent-replayed"] == "true"
    assert "already used" in assert_problem(again, 400, "token-invalid")["detail"]
    assert app.state.probe.calls == 1
