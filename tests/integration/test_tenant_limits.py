"""What a tenant resolver may answer: tenants the store cannot key records by are refused before
the claim, and tenants that differ only in their Unicode normalisation stay apart.

Found by probing: a resolver answering a long tenant (over 2704 bytes after compression: the
primary key's btree entry) got the driver's error from PostgreSQL, in lease mode as a bare `500
Internal Server Error` (text/plain) from the claim, in transactional mode as a `500` after the
handler had run (its writes rolled back at the completion). `MemoryStore` took it, so a test suite
on it passed. Now a tenant over `MAX_TENANT_BYTES` bytes of UTF-8 (or holding a NUL or an
unpaired surrogate) is refused before the claim on either store: `500 server-misconfigured`,
logged once, by type, never its value.
"""

from __future__ import annotations

import logging
import secrets
import unicodedata
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy, PostgresStore
from idem_middleware.status import status_route
from idem_middleware.store.base import State
from idem_middleware.tenant import MAX_TENANT_BYTES
from tests.apps import assert_problem, key

pytestmark = pytest.mark.asyncio


def _app(
    store: MemoryStore | PostgresStore, tenant: str, mode: Mode, calls: list[str]
) -> Starlette:
    async def pay(request: Request) -> Response:
        calls.append(tenant)
        return JSONResponse({"n": len(calls)}, status_code=201)

    return Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                tenant_resolver=lambda scope: tenant,
                default_policy=Policy(mode=mode),
            )
        ],
    )


async def _post(app: Starlette) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.post("/pay", headers=key("k"), content=b"{}")


async def _records(store: MemoryStore | PostgresStore) -> int:
    if isinstance(store, PostgresStore):
        n: int = await store.pool.fetchval("SELECT count(*) FROM idem_requests")
        return n
    return len(await store.list_records(states=list(State)))


_TOO_LONG = {
    # Incompressible: PostgreSQL's btree refuses it (a repeated character compresses, and fit).
    "random": secrets.token_hex(MAX_TENANT_BYTES // 2 + 1),
    "utf8-bytes": "é" * (MAX_TENANT_BYTES // 2 + 1),  # 513 characters, 1026 bytes
    "nul": "ten\x00ant",
}


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("tenant", list(_TOO_LONG.values()), ids=list(_TOO_LONG))
async def test_a_tenant_the_store_cannot_key_by_is_refused_before_the_claim(
    store: MemoryStore | PostgresStore,
    caplog: pytest.LogCaptureFixture,
    tenant: str,
    mode: Mode,
) -> None:
    calls: list[str] = []
    app = _app(store, tenant, mode, calls)
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        first = await _post(app)
        again = await _post(app)
    for answer in (first, again):
        assert "cannot identify" in assert_problem(answer, 500, "server-misconfigured")["detail"]
    assert calls == [], "refused before the handler"
    assert await _records(store) == 0
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1, "logged once"
    assert "cannot hold" in logged[0].getMessage()
    assert tenant[:8] not in logged[0].getMessage()


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_tenant_of_the_most_bytes_is_guarded(
    store: MemoryStore | PostgresStore, mode: Mode
) -> None:
    calls: list[str] = []
    tenant = "é" * (MAX_TENANT_BYTES // 4) + secrets.token_hex(MAX_TENANT_BYTES // 4)
    assert len(tenant.encode()) == MAX_TENANT_BYTES
    app = _app(store, tenant, mode, calls)
    first = await _post(app)
    again = await _post(app)
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert len(calls) == 1


async def test_the_status_route_refuses_a_tenant_too_long_to_key_by(
    pg_store: PostgresStore,
) -> None:
    tenant = _TOO_LONG["random"]
    app = Starlette(routes=[status_route(pg_store, tenant_resolver=lambda scope: tenant)])
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/idempotency/status", params={"operation": "POST /pay", "key": "k"})
    assert_problem(r, 500, "server-misconfigured")


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_tenants_that_normalise_alike_keep_their_own_records(
    store: MemoryStore | PostgresStore, mode: Mode
) -> None:
    """ "café" composed and decomposed are two tenants (a resolver that wants one normalises):
    neither is ever replayed the other's response."""
    calls: list[str] = []
    answers: list[Any] = []
    for form in ("NFC", "NFD", "NFKC"):
        tenant = unicodedata.normalize(form, "café ﬁ")  # (NFKC also folds the ligature)
        answers.append(await _post(_app(store, tenant, mode, calls)))
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert [a.json()["n"] for a in answers] == [1, 2, 3]
    assert not any("idempotent-replayed" in a.headers for a in answers)
    assert await _records(store) == 3
