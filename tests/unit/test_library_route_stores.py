"""The status and token routes read (and issue through) the store they are given; the
middleware writes its own. Found by probing: a route given another store than the middleware's
was taken without a word, then every status was a 404 and every token issued was refused at
its first use. Startup now warns, naming the route. Two PostgresStores on one pool or one DSN
(an app's and a route's, made apart) keep the same records, and are not warned about."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, PostgresStore
from idem_middleware.library_routes import same_records
from idem_middleware.status import status_route
from idem_middleware.tokens import TokenIssuer, token_route
from tests.integration.test_startup_checks import startup as lifespan_startup
from tests.unit.test_route_problem_base import pay

DSN = "postgresql://app@db.internal/payments"


def _served(route: BaseRoute, store: MemoryStore) -> Starlette:
    policies = {"POST /pay": Policy(require_token=True)}
    return Starlette(
        routes=[route, Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies=policies,
                tenant_resolver=lambda scope: "t",
            )
        ],
    )


def _route(kind: str, store: MemoryStore) -> BaseRoute:
    if kind == "status":
        return status_route(store)
    return token_route(TokenIssuer(store, secret=b"s" * 32))


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_a_library_route_on_another_store_is_warned_about(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await lifespan_startup(_served(_route(kind, MemoryStore()), MemoryStore()))
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    warned = [r.getMessage() for r in caplog.records if "another store" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"the {kind} route /idempotency/{kind} was given another store" in warned[0]


@pytest.mark.parametrize("kind", ["status", "tokens"])
async def test_a_library_route_on_the_middlewares_store_is_not(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await lifespan_startup(_served(_route(kind, store), store))
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    assert not [r for r in caplog.records if "another store" in r.getMessage()]


def test_two_postgres_stores_on_one_dsn_keep_thesame_records() -> None:
    assert same_records(PostgresStore(dsn=DSN), PostgresStore(dsn=DSN))
    assert not same_records(PostgresStore(dsn=DSN), PostgresStore(dsn=DSN + "_other"))
    assert not same_records(PostgresStore(dsn=DSN), MemoryStore())
    assert not same_records(MemoryStore(), MemoryStore())
