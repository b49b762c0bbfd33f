"""OpenAPI in the apps that adopt the middleware: sub-apps behind a `Host`, documents the
additions are applied to twice, and what the app documents itself (its headers, its own
Idempotency-Key parameter) kept."""

from __future__ import annotations

import copy
from typing import Annotated, Any
from uuid import UUID

import httpx
from fastapi import FastAPI, Header
from openapi_spec_validator import validate
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Host, Route
from starlette.schemas import SchemaGenerator

from idem_middleware import (
    IdempotencyMiddleware,
    KeyFromBody,
    MemoryStore,
    idempotent,
    not_idempotent,
)
from idem_middleware.fastapi import document, install
from idem_middleware.openapi import document_openapi


def _keys(operation: dict[str, Any]) -> list[dict[str, Any]]:
    parameters = operation.get("parameters", [])
    return [p for p in parameters if p["in"] == "header" and p["name"].lower() == "idempotency-key"]


def _tenant(scope: Any) -> str:
    return "t1"


# --- the operations of a sub-app are picked by route, not by path prefix ---------------------


async def test_a_sub_app_behind_a_host_documents_only_what_is_guarded_there() -> None:
    """Found by probing: a Host gives no path prefix, and the operations were picked by one,
    so admin.local's `@not_idempotent` POST /orders was documented with the key and problems
    of api.local's guarded POST /orders (and the parent's own unguarded /orders too)."""
    api, admin, app = FastAPI(), FastAPI(), FastAPI()

    @api.post("/orders")
    async def api_orders() -> dict[str, str]:
        return {}

    @admin.post("/orders")
    @not_idempotent
    async def admin_orders() -> dict[str, str]:
        return {}

    install(app, store=MemoryStore(), tenant_resolver=_tenant)
    app.router.routes.append(Host("api.local", app=api))
    app.router.routes.append(Host("admin.local", app=admin))
    app.host("other.local", admin)  # the same app behind a second host: still unguarded

    @app.post("/orders")  # (after the hosts: any other host's)
    @not_idempotent
    async def own_orders() -> dict[str, str]:
        return {}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.post("http://api.local/orders")).status_code == 400  # no key
        assert (await client.post("http://admin.local/orders")).status_code == 200
        assert (await client.post("http://elsewhere/orders")).status_code == 200
    for sub in (api, admin, app):
        validate(sub.openapi())
    assert _keys(api.openapi()["paths"]["/orders"]["post"])
    assert _keys(admin.openapi()["paths"]["/orders"]["post"]) == []
    assert "409" not in admin.openapi()["paths"]["/orders"]["post"]["responses"]
    assert _keys(app.openapi()["paths"]["/orders"]["post"]) == []


# --- applied twice, the additions change nothing -------------------------------------------


class _Body(BaseModel):
    x: int


def _busy_app() -> Any:
    app = FastAPI()
    install(app, store=MemoryStore(), tenant_resolver=_tenant, www_authenticate="Bearer")
    own = {409: {"description": "Conflict of the app"}, 400: {"description": "App bad"}}

    @app.post("/orders", status_code=201, responses={**own, 202: {"description": "queued"}})
    @idempotent(accept_while_in_flight=True)
    async def orders(
        body: _Body, idempotency_key: Annotated[str, Header(min_length=8)]
    ) -> dict[str, str]:
        return {}

    @app.post("/jobs")
    @idempotent(accept_while_in_flight=True)
    async def jobs() -> dict[str, str]:
        return {}

    @app.post("/hooks", description="Receives webhooks.")
    @idempotent(key_source=KeyFromBody("/event/id"))
    async def hooks() -> dict[str, str]:
        return {}

    return app


def test_documenting_a_documented_schema_changes_nothing() -> None:
    """Found by probing: every merged description grew by the middleware's again ("Validation
    Error / X / X"), the body key's line was repeated, and the in-flight 202 added the first
    time was given Idempotent-Replayed the second."""
    app = _busy_app()
    once = copy.deepcopy(app.openapi())
    validate(once)
    assert document_openapi(copy.deepcopy(once), app) == once


def test_the_extending_openapi_recipe_over_a_documented_app_documents_once() -> None:
    """Found by probing: FastAPI's recipe wraps the `app.openapi` `install` documented, then
    `document(app)` (as the docs say) documented its output again: descriptions doubled."""
    app = _busy_app()
    once = copy.deepcopy(app.openapi())
    previous = app.openapi
    app.openapi_schema = None

    def custom() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = previous()
            app.openapi_schema["info"]["x-logo"] = {"url": "/logo.png"}
        return app.openapi_schema

    app.openapi = custom  # type: ignore[method-assign]
    document(app)
    assert app.openapi()["paths"] == once["paths"]


async def _create(request: Request) -> JSONResponse:
    """
    responses:
      201:
        description: made
      409:
        description: the app's own conflict
    """
    return JSONResponse({}, status_code=201)


def test_a_cached_starlette_schema_documented_on_each_request_stays_the_same() -> None:
    """Found by probing: a Starlette app that keeps its schema dict and passes it through
    `document_openapi` on each request got longer descriptions each time."""
    app = Starlette(
        routes=[Route("/things", _create, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=_tenant)
        ],
    )
    generator = SchemaGenerator({"openapi": "3.0.0", "info": {"title": "t", "version": "1"}})
    cached = generator.get_schema(app.routes)
    once = copy.deepcopy(document_openapi(cached, app))
    validate(once)
    assert document_openapi(document_openapi(cached, app), app) == once


# --- what the app documents itself is kept -------------------------------------------------


def test_the_apps_own_headers_are_kept_in_any_case() -> None:
    """Found by probing: the app's Retry-After (an HTTP-date) on its 503 was replaced by the
    middleware's integer, and its lower-case `retry-after` and `www-authenticate` got a second
    entry in another case."""
    app = FastAPI()
    install(app, store=MemoryStore(), tenant_resolver=_tenant, www_authenticate="Bearer")
    date = {"description": "an HTTP-date", "schema": {"type": "string", "format": "http-date"}}
    responses: dict[int | str, dict[str, Any]] = {
        503: {"description": "maintenance", "headers": {"Retry-After": date}},
        409: {
            "description": "conflict",
            "headers": {"retry-after": {"schema": {"type": "integer"}}},
        },
        401: {
            "description": "who",
            "headers": {"www-authenticate": {"schema": {"type": "string"}}},
        },
        201: {"description": "made", "headers": {"idempotent-replayed": {"schema": {}}}},
    }

    @app.post("/x", status_code=201, responses=responses)
    async def x() -> dict[str, str]:
        return {}

    schema = app.openapi()
    validate(schema)
    documented = schema["paths"]["/x"]["post"]["responses"]
    assert documented["503"]["headers"] == {"Retry-After": date}
    assert list(documented["409"]["headers"]) == ["retry-after"]
    assert list(documented["401"]["headers"]) == ["www-authenticate"]
    assert list(documented["201"]["headers"]) == ["idempotent-replayed"]


def test_the_apps_own_key_parameter_keeps_its_constraints() -> None:
    """Found by probing: the app's `Header(..., min_length=8)` was replaced by an optional key
    of one character or more (key_required=False), though a request without it, or with a
    shorter one, is a 422; a key read as a UUID lost its format."""
    app = FastAPI()
    install(app, store=MemoryStore(), tenant_resolver=_tenant)

    @app.post("/optional")
    @idempotent(key_required=False)
    async def optional(idempotency_key: Annotated[str, Header(min_length=8)]) -> dict[str, str]:
        return {}

    @app.post("/uuid")
    async def uuid(idempotency_key: Annotated[UUID, Header()]) -> dict[str, str]:
        return {}

    @app.post("/plain")
    async def plain(idempotency_key: Annotated[str | None, Header()] = None) -> dict[str, str]:
        return {}

    schema = app.openapi()
    validate(schema)
    paths = schema["paths"]
    [optional_key] = _keys(paths["/optional"]["post"])
    assert optional_key["required"] is True
    assert "Optional:" not in optional_key["description"]
    own, library = optional_key["schema"]["allOf"]
    assert own["minLength"] == 8
    assert library["maxLength"] == 512
    [uuid_key] = _keys(paths["/uuid"]["post"])
    assert {"type": "string", "format": "uuid"}.items() <= uuid_key["schema"]["allOf"][0].items()
    [plain_key] = _keys(paths["/plain"]["post"])  # (the policy requires it: required)
    assert plain_key["required"] is True
    assert "pattern" in plain_key["schema"]["allOf"][1]


# --- a sub-app mounted after install ---------------------------------------------------------


def test_a_sub_app_mounted_after_install_is_documented_before_the_app_runs() -> None:
    """Found by probing: the sub-app was found when the parent first ran, so its `openapi()`
    exported by a script that never runs the app had no key. One that installs a middleware of
    its own afterwards documents itself."""
    app, sub, own = FastAPI(), FastAPI(), FastAPI()
    install(app, store=MemoryStore(), tenant_resolver=_tenant)

    @sub.post("/orders")
    async def orders() -> dict[str, str]:
        return {}

    @own.post("/pay")
    @idempotent(key_required=False)
    async def pay() -> dict[str, str]:
        return {}

    app.mount("/v1", sub)
    app.mount("/own", own)
    install(own, store=MemoryStore(), tenant_resolver=_tenant)
    validate(sub.openapi())
    assert _keys(sub.openapi()["paths"]["/orders"]["post"])
    [key] = _keys(own.openapi()["paths"]["/pay"]["post"])
    assert key["required"] is False  # its own middleware's policy, not the parent's


def test_documenting_a_mounted_sub_app_without_a_middleware_of_its_own_keeps_the_parents() -> None:
    """`document(sub)` on a sub-app the parent's middleware documents (a module documenting each
    app it builds; `document` is idempotent): it took the sub-app for one with a middleware of
    its own, and the parent's additions were gone from its document for good (found in review)."""
    app, sub = FastAPI(), FastAPI()

    @sub.post("/orders")
    async def orders() -> dict[str, str]:
        return {}

    app.mount("/v1", sub)
    install(app, store=MemoryStore(), tenant_resolver=_tenant)
    document(sub)
    assert _keys(sub.openapi()["paths"]["/orders"]["post"])
    document(app)
    assert _keys(sub.openapi()["paths"]["/orders"]["post"])


def test_a_fastapi_default_app_documents_the_key_its_routes_are_guarded_by() -> None:
    """Found in review: a router's default app (`app.router.default = legacy`) is guarded and
    listed, but its own `openapi()` was found under no place in the app, and documented no key."""
    legacy = FastAPI()

    @legacy.post("/refund")
    async def refund() -> dict[str, int]:
        return {"x": 1}

    app = FastAPI()
    app.router.default = legacy
    install(app, store=MemoryStore())
    parameters = legacy.openapi()["paths"]["/refund"]["post"].get("parameters", [])
    assert any(p.get("name", "").lower() == "idempotency-key" for p in parameters), parameters
