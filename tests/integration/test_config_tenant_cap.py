"""`max_tenant_connections` exists so that one tenant cannot take the whole pool
(docs/concurrency.md: size it below the pool's `max_size`). At or above the pool size it bounds
nothing, and nothing said so: the startup now warns, naming both numbers, once the app's
lifespan has opened the store."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_startup_checks import messages, startup


async def _ok(request: Any) -> Any:  # pragma: no cover - never served
    raise AssertionError


def _app(store: PostgresStore, cap: int | None) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with store:
            yield

    return Starlette(
        routes=[Route("/pay", _ok, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=lambda scope: "t",
                max_tenant_connections=cap,
            )
        ],
        lifespan=lifespan,
    )


@pytest.mark.parametrize(("cap", "warned"), [(3, True), (5, True), (2, False), (None, False)])
async def test_a_tenant_cap_not_below_the_pool_size_is_warned_of(
    db_dsn: str, caplog: pytest.LogCaptureFixture, cap: int | None, warned: bool
) -> None:
    caplog.set_level(logging.WARNING, "idem_middleware")
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=3, listen=False)
    sent = await startup(_app(store, cap))
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    found = [m for m in messages(caplog, logging.WARNING) if "max_tenant_connections" in m]
    if warned:
        assert found == [
            f"idempotency: max_tenant_connections={cap} is not below the store's pool size "
            "(max_size=3): one tenant can still hold every connection. Set it below 3, or give "
            "the pool more connections"
        ]
    else:
        assert found == []


async def test_a_middleware_switched_off_is_not_warned_of(
    db_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The kill switch on: it guards nothing, so its cap bounds nothing either way.)"""
    monkeypatch.setenv("IDEM_MIDDLEWARE_DISABLED", "1")
    caplog.set_level(logging.WARNING, "idem_middleware")
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=3, listen=False)
    sent = await startup(_app(store, 3))
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    assert [m for m in messages(caplog, logging.WARNING) if "max_tenant_connections" in m] == []
