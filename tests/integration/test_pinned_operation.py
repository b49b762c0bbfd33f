"""A route's pinned operation name (`Policy.operation`): its records keep their name when its
path changes, so a retry that reaches the renamed route (the next release) replays the outcome
instead of running again, on either store and in either mode; the status and token routes know
the operation by that name. A name that cannot be one is refused when the policy is made, and
one that names another method than its route's fails the startup."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import (
    ConfigurationError,
    IdempotencyMiddleware,
    MemoryStore,
    Mode,
    Policy,
    PostgresStore,
    idempotent,
)
from idem_middleware.reconcile import ReconcileContext, Reconciliation, StillUnknown
from idem_middleware.status import status_route
from idem_middleware.store.base import Store
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import BearerBackend, assert_problem, assert_replay_of, client, key, records
from tests.integration.test_startup_checks import messages, startup

PINNED = "POST /payments"


def release(store: Store, path: str, effects: list[int], **policy: Any) -> Starlette:
    """One release of a payments API: `POST path`, guarded by `policy`; every run of the
    handler is appended to `effects` (shared by the releases, as the bank is)."""

    @idempotent(**policy)
    async def pay(request: Request) -> Response:
        amount = (await request.json())["amount"]
        effects.append(amount)
        return JSONResponse({"paid": amount, "run": len(effects)}, status_code=201)

    return Starlette(
        routes=[Route(path, pay, methods=["POST"]), status_route(store)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_retry_reaching_the_renamed_route_replays(store: Store, mode: Mode) -> None:
    effects: list[int] = []
    old = release(store, "/v1/pay", effects, operation=PINNED, mode=mode)
    new = release(store, "/v2/payments", effects, operation=PINNED, mode=mode)
    async with client(old) as c:
        first = await c.post("/v1/pay", json={"amount": 5}, headers=key("pay-1"))
    async with client(new) as c:
        again = await c.post("/v2/payments", json={"amount": 5}, headers=key("pay-1"))
        other = await c.post("/v2/payments", json={"amount": 6}, headers=key("pay-1"))
        status = await c.get("/idempotency/status", params={"operation": PINNED, "key": "pay-1"})
        fresh = await c.post("/v2/payments", json={"amount": 7}, headers=key("pay-2"))
    assert first.status_code == 201
    assert_replay_of(again, first)
    # (The request is fingerprinted under the name too: another body is refused, never run.)
    assert_problem(other, 422, "key-reused")
    assert status.status_code == 200, status.text
    assert status.json()["state"] == "succeeded"
    assert fresh.status_code == 201
    assert effects == [5, 7]
    if isinstance(store, PostgresStore):
        names = {row["operation"] for row in await records(store.pool)}
        assert names == {PINNED}


async def test_the_moved_route_pins_the_name_it_had(store: Store) -> None:
    """The way to move a route that was never pinned: the release that moves it pins the name
    the records already have."""
    effects: list[int] = []
    old = release(store, "/v1/pay", effects)
    new = release(store, "/api/v2/payments", effects, operation="POST /v1/pay")
    async with client(old) as c:
        first = await c.post("/v1/pay", json={"amount": 5}, headers=key("pay-1"))
    async with client(new) as c:
        again = await c.post("/api/v2/payments", json={"amount": 5}, headers=key("pay-1"))
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert effects == [5]


async def test_without_a_pinned_name_the_renamed_route_runs_again(store: Store) -> None:
    """What the name is for: by default a route's name is its method and template, so the
    rename starts a new key space (documented as a deploy that needs care)."""
    effects: list[int] = []
    old = release(store, "/v1/pay", effects)
    new = release(store, "/v2/pay", effects)
    async with client(old) as c:
        first = await c.post("/v1/pay", json={"amount": 5}, headers=key("pay-1"))
    async with client(new) as c:
        again = await c.post("/v2/pay", json={"amount": 5}, headers=key("pay-1"))
    assert first.status_code == again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert effects == [5, 5]


async def test_tokens_are_issued_for_the_pinned_name(pg_store: PostgresStore) -> None:
    effects: list[int] = []
    app = release(pg_store, "/v1/pay", effects, operation=PINNED, require_token=True)
    app.router.routes.append(token_route(TokenIssuer(pg_store, secret=b"s" * 32)))
    async with client(app) as c:
        by_path = await c.post("/idempotency/tokens", json={"operation": "POST /v1/pay"})
        issued = await c.post("/idempotency/tokens", json={"operation": PINNED})
        assert issued.status_code == 201, issued.text
        paid = await c.post("/v1/pay", json={"amount": 5}, headers=key(issued.json()["token"]))
    # The template's name is not the operation's: a token for it would never be accepted.
    assert_problem(by_path, 400, "body-invalid")
    assert paid.status_code == 201, paid.text
    assert effects == [5]


# -- names refused -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "payments",
        "POST payments",
        "post /payments",
        b"POST /x",
        "",
        "POST /pay\ud800",  # (from a config file's JSON: PostgreSQL text cannot hold it)
        "POST /" + "\u652f" * 400,  # 1,206 bytes of UTF-8: too long for the record's key
    ],
)
def test_a_name_that_cannot_be_an_operation_is_refused(name: Any) -> None:
    with pytest.raises(ConfigurationError, match="operation must be a name like"):
        Policy(operation=name)


def test_a_default_policy_with_a_name_is_refused() -> None:
    """Every route it guards would share one key space."""
    with pytest.raises(ConfigurationError, match="would share one key space"):
        IdempotencyMiddleware(
            Starlette(), store=MemoryStore(), default_policy=Policy(operation=PINNED)
        )


async def test_a_name_of_another_method_fails_the_startup(caplog: pytest.LogCaptureFixture) -> None:
    """A route serving POST and PUT under one pinned name would replay a POST's outcome to a
    PUT with the same key."""
    policy = Policy(operation=PINNED)

    async def both(request: Request) -> Response:
        return Response(status_code=204)

    app = Starlette(
        routes=[Route("/pay", both, methods=["POST", "PUT"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore(), policies={"PUT /pay": policy}),
        ],
    )
    sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert (
        "PUT /pay has operation='POST /payments', which names another method"
        in (sent[0]["message"])
    )


async def test_a_route_added_after_the_startup_check_is_refused_at_its_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The startup check never saw it: the request is refused (500), never run under a name
    that is another method's."""
    effects: list[int] = []
    app = release(MemoryStore(), "/v1/pay", effects, operation=PINNED)
    async with client(app) as c:
        assert (await c.post("/v1/pay", json={"amount": 1}, headers=key("a"))).status_code == 201

        @idempotent(operation=PINNED)
        async def put(request: Request) -> Response:
            effects.append(-1)
            return Response(status_code=204)

        app.router.routes.append(Route("/v1/pay/{pid}", put, methods=["PUT"]))
        with caplog.at_level(logging.ERROR, logger="idem_middleware"):
            refused = await c.put("/v1/pay/9", json={"amount": 1}, headers=key("a"))
    assert_problem(refused, 500, "server-misconfigured")
    assert effects == [1]
    assert any("names another method" in m for m in messages(caplog, logging.ERROR))


async def test_two_routes_sharing_a_pinned_name_are_told_at_startup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both paths served (the old one kept for the clients' retry window): one key space, as
    meant, and the startup log says so."""
    store = MemoryStore()

    @idempotent(operation=PINNED)
    async def pay(request: Request) -> Response:
        return Response(status_code=204)

    app = Starlette(
        routes=[Route("/v1/pay", pay, methods=["POST"]), Route("/v2/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store),
        ],
    )
    with caplog.at_level(logging.INFO, logger="idem_middleware"):
        sent = await startup(app)
    assert sent[0]["type"] == "lifespan.startup.complete"
    warned = [m for m in messages(caplog, logging.WARNING) if "names more than one" in m]
    assert warned == [
        "idempotency: POST /payments names more than one guarded route: they share one key "
        "space, and a key used on one replays its response to the others (as while a renamed "
        "route is served at both paths)"
    ]
    guarding = [m for m in messages(caplog, logging.INFO) if m.startswith("idempotency: guarding")]
    assert [m.split(" (")[0] for m in guarding] == ["idempotency: guarding POST /payments"] * 2


async def test_routes_sharing_a_name_must_agree_on_what_is_read_per_operation() -> None:
    """The token route, the status route and the CLI read one policy per operation: routes that
    share a name (the old path kept beside the new one) with tokens on one only made every
    token request refused and the tokened route unusable."""

    async def pay(request: Request) -> Response:
        return Response(status_code=204)

    old = idempotent(operation=PINNED)(pay)
    new = idempotent(operation=PINNED, require_token=True)(pay)
    app = Starlette(
        routes=[Route("/v1/pay", old, methods=["POST"]), Route("/v2/pay", new, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "the 2 guarded routes named POST /payments differ in mode" in sent[0]["message"]


async def test_a_class_level_name_on_an_endpoint_class_names_the_methods_it_serves() -> None:
    """An `HTTPEndpoint` serving POST alone was listed for every unsafe method: a class-level
    pin named PUT, PATCH and DELETE too, and failed the startup."""

    @idempotent(operation=PINNED)
    class Pay(HTTPEndpoint):
        async def post(self, request: Request) -> Response:
            return JSONResponse({"paid": True}, status_code=201)

    app = Starlette(
        routes=[Route("/v2/pay", Pay)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    assert [m["type"] for m in await startup(app)] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    async with client(app) as c:
        first = await c.post("/v2/pay", json={}, headers=key("k"))
        again = await c.post("/v2/pay", json={}, headers=key("k"))
    assert first.status_code == 201
    assert_replay_of(again, first)


async def test_routes_sharing_a_name_and_a_bound_method_reconciler_start() -> None:
    """`bank.ask` is a new object at each access: two routes given it were told they differ."""

    class Bank:
        async def ask(self, context: ReconcileContext) -> Reconciliation:
            return StillUnknown()

    bank = Bank()

    async def pay(request: Request) -> Response:
        return Response(status_code=204)

    lease = {"operation": PINNED, "mode": Mode.LEASE}
    old = idempotent(reconciler=bank.ask, **lease)(pay)
    new = idempotent(reconciler=bank.ask, **lease)(pay)
    app = Starlette(
        routes=[Route("/v1/pay", old, methods=["POST"]), Route("/v2/pay", new, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    assert (await startup(app))[0]["type"] == "lifespan.startup.complete"
