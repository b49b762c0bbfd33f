"""A second IdempotencyMiddleware inside the first never handles the requests the outer one
guards (it passes them on). Found by probing: `install()` called twice on one app, with two
stores, two tenant resolvers and two problem bases, was taken without a word, and the first
call's settings never applied; a mounted app's own middleware with another problem base and
challenge was ignored the same way (its OpenAPI document promised them).

install() twice on one app is refused; an inner middleware made with other settings than the
outer one is warned about at startup, naming them (two stores on one database, two resolvers
alike, are common and work: not refused)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount

from idem_middleware import ConfigurationError, IdempotencyMiddleware, MemoryStore, PostgresStore
from idem_middleware.fastapi import install
from tests.integration.test_startup_checks import startup


def _resolver(scope: object) -> str:
    return "t"


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/pay")
    async def pay() -> dict[str, bool]:
        return {"ok": True}

    return app


def test_install_twice_on_one_app_is_refused() -> None:
    app = _app()
    install(app, store=MemoryStore(), tenant_resolver=_resolver)
    with pytest.raises(ConfigurationError, match="install\\(\\) was called on this app already"):
        install(app, store=MemoryStore(), tenant_resolver=_resolver)
    install(_app(), store=MemoryStore(), tenant_resolver=_resolver)  # (another app: its own)


def test_install_on_a_starlette_app_is_refused_before_anything_is_added() -> None:
    """Found by probing: it added the middleware, marked the app installed, then failed on
    `app.openapi` (a Starlette app has none); a second call then said it had been called."""
    app = Starlette()
    with pytest.raises(ConfigurationError, match="install\\(\\) is for a FastAPI app"):
        install(app, store=MemoryStore(), tenant_resolver=_resolver)  # type: ignore[arg-type]
    assert app.user_middleware == []


async def _started(app: object, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings of the app's lifespan startup, which must complete."""
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        sent = await startup(app)
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_middleware_in_the_apps_list_with_other_settings_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    app = _app()
    app.user_middleware.append(
        Middleware(
            IdempotencyMiddleware,
            store=MemoryStore(),
            tenant_resolver=_resolver,
            problem_base="https://inner.example/p/",
        )
    )
    install(app, store=store, tenant_resolver=_resolver)
    (warned,) = await _started(app, caplog)  # (once: by the outer one, of the inner)
    assert "in the app's middleware list has another store, problem_base than" in warned


async def test_a_mounted_apps_middleware_with_other_settings_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    sub = _app()
    install(sub, store=store, tenant_resolver=_resolver, www_authenticate="Basic")
    parent = Starlette(
        routes=[Mount("/v1", sub)],
        middleware=[Middleware(IdempotencyMiddleware, store=store, tenant_resolver=_resolver)],
    )
    (warned,) = await _started(parent, caplog)
    assert "in an app mounted below has another www_authenticate than" in warned


async def test_alike_middlewares_are_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    sub = _app()
    install(sub, store=store, tenant_resolver=_resolver)
    parent = Starlette(
        routes=[Mount("/v1", sub)],
        middleware=[Middleware(IdempotencyMiddleware, store=store, tenant_resolver=_resolver)],
    )
    assert await _started(parent, caplog) == []


async def test_alike_middlewares_in_one_list_are_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nor is the inner one named as a middleware that may change the route: it was ("runs
    after IdempotencyMiddleware, ... sends requests to routes the middleware saw as
    unguarded")."""
    store = MemoryStore()
    app = _app()
    app.user_middleware.append(
        Middleware(IdempotencyMiddleware, store=store, tenant_resolver=_resolver)
    )
    install(app, store=store, tenant_resolver=_resolver)
    assert await _started(app, caplog) == []


async def test_two_postgres_stores_on_one_dsn_are_alike(caplog: pytest.LogCaptureFixture) -> None:
    """A sub-app also served on its own, with a store of its own on the parent's database: the
    same records, not warned about (it was, at every startup: found in review). The stores are
    never opened: the check runs first, and no request is made."""
    dsn = "postgresql://app@127.0.0.1:1/shop"
    sub = _app()
    install(sub, store=PostgresStore(dsn=dsn), tenant_resolver=_resolver)
    parent = Starlette(
        routes=[Mount("/v1", sub)],
        middleware=[
            Middleware(
                IdempotencyMiddleware, store=PostgresStore(dsn=dsn), tenant_resolver=_resolver
            )
        ],
    )
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        parent.middleware_stack = parent.build_middleware_stack()
        middleware = parent.middleware_stack
        while not isinstance(middleware, IdempotencyMiddleware):
            middleware = middleware.app
        middleware._check(parent)
    assert not [r for r in caplog.records if "another IdempotencyMiddleware" in r.getMessage()]
