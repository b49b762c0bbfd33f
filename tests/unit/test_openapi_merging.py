"""OpenAPI: what the middleware documents is merged into what the app documents (its own 202,
a `$ref` response), and a `require_token` key is documented as the token it must be."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
from openapi_spec_validator import validate
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.schemas import SchemaGenerator

from idem_middleware import IdempotencyMiddleware, KeyFromBody, MemoryStore, Policy, idempotent
from idem_middleware.openapi import document_openapi
from idem_middleware.tokens import TokenIssuer, token_route
from tests.apps import BearerBackend, client


def _key_description(operation: dict[str, Any]) -> str:
    [parameter] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    return str(parameter["description"])


def _references(node: Any) -> Iterator[dict[str, Any]]:
    """Every object of the document holding a `$ref`."""
    if isinstance(node, dict):
        if "$ref" in node:
            yield node
        for value in node.values():
            yield from _references(value)
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)


# --- an operation whose own success is a 202 ----------------------------------------------


def _job_app() -> Any:
    from fastapi import FastAPI
    from pydantic import BaseModel

    from idem_middleware.fastapi import install

    class Job(BaseModel):
        job_id: str

    app = FastAPI()
    own = {
        "headers": {
            "location": {"description": "The job", "schema": {"type": "string"}},
            "X-Job-Id": {"schema": {"type": "string"}},
        }
    }

    @app.post("/jobs", status_code=202, response_model=Job, responses={202: own})
    @idempotent(accept_while_in_flight=True)
    async def start_job() -> Job:
        return Job(job_id="j-1")

    install(app, store=MemoryStore())
    return app


def test_an_operations_own_202_is_kept_beside_the_in_flight_202() -> None:
    """Found by probing: the in-flight 202 replaced the route's own, its Job schema and the
    Idempotent-Replayed header it had just been given."""
    schema = _job_app().openapi()
    validate(schema)
    accepted = schema["paths"]["/jobs"]["post"]["responses"]["202"]
    shapes = accepted["content"]["application/json"]["schema"]["anyOf"]
    assert {"$ref": "#/components/schemas/Job"} in shapes
    [processing] = [s for s in shapes if "$ref" not in s]
    jsonschema.validate({"status": "processing", "location": "/s?k=1"}, processing)
    # The route's headers kept (its `location` rather than a second Location), the
    # middleware's added.
    assert sorted(accepted["headers"]) == [
        "Cache-Control",
        "Idempotent-Replayed",
        "Retry-After",
        "X-Job-Id",
        "location",
    ]
    assert accepted["headers"]["location"]["description"] == "The job"
    assert accepted["description"].startswith("Successful Response / ")
    assert "still running" in accepted["description"]


# --- a require_token operation -------------------------------------------------------------


def _token_app(*routes: Any) -> Any:
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    store = MemoryStore()
    app = FastAPI()

    @app.post("/orders", status_code=201)
    @idempotent(require_token=True)
    async def create_order() -> dict[str, str]:
        return {}

    @app.post("/plain", status_code=201)
    async def plain() -> dict[str, str]:
        return {}

    @app.post("/hooks")
    @idempotent(key_source=KeyFromBody("/id"), require_token=True)
    async def hooks() -> dict[str, str]:
        return {}

    issuer = TokenIssuer(store, secret=b"s" * 32)
    app.router.routes.extend(route(issuer) for route in routes)
    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerBackend())
    return app


async def test_a_require_token_key_is_documented_as_the_token_it_must_be() -> None:
    """Found by probing: the key was documented as "a new random value (a UUID) per intent",
    which a require_token operation refuses (400 token-invalid)."""
    app = _token_app(lambda issuer: Mount("/v1", routes=[token_route(issuer, path="/tokens")]))
    schema = app.openapi()
    validate(schema)
    paths = schema["paths"]
    described = _key_description(paths["/orders"]["post"])
    assert "UUID) per intent" not in described
    assert "one-time token issued by the server" in described
    assert 'from `POST /v1/tokens` with `{"operation": "POST /orders"}`' in described
    assert "400 token-invalid" in described
    assert "UUID) per intent" in _key_description(paths["/plain"]["post"])
    assert "`POST /v1/tokens`" in paths["/hooks"]["post"]["description"]
    # Doing as documented works: the body it names gets a token the operation accepts.
    [body] = re.findall(r"with `(\{.*?\})`", described)
    async with client(app) as c:
        issued = await c.post("/v1/tokens", json=json.loads(body))
        assert issued.status_code == 201, issued.text
        made = await c.post("/orders", headers={"idempotency-key": issued.json()["token"]})
        assert made.status_code == 201, made.text


def test_without_a_token_route_in_sight_the_key_still_says_token() -> None:
    described = _key_description(_token_app().openapi()["paths"]["/orders"]["post"])
    assert "get one from the server's token route" in described
    assert "UUID) per intent" not in described


# --- responses given as a $ref -------------------------------------------------------------


async def _create(request: Request) -> JSONResponse:
    """
    responses:
      "201":
        $ref: '#/components/responses/Created'
      "200":
        $ref: '#/components/responses/Again'
      "409":
        $ref: '#/components/responses/Conflict'
    """
    return JSONResponse({}, 201)


async def _elsewhere(request: Request) -> JSONResponse:
    """
    responses:
      "201":
        $ref: 'shared.yaml#/components/responses/Created'
      "409":
        $ref: 'shared.yaml#/components/responses/Conflict'
    """
    return JSONResponse({}, 201)


def _referencing_schema(version: str, endpoint: Any = _create) -> dict[str, Any]:
    app = Starlette(
        routes=[Route("/things", endpoint, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy())
        ],
    )
    responses = {
        "Created": {"description": "made", "headers": {"X-Id": {"schema": {"type": "string"}}}},
        "Again": {"$ref": "#/components/responses/Created"},  # a reference to a reference
        "Conflict": {"description": "conflict"},
    }
    base = {"openapi": version, "info": {"title": "t", "version": "1"}}
    generator = SchemaGenerator({**base, "components": {"responses": responses}})
    return document_openapi(generator.get_schema(app.routes), app)


def test_a_referenced_response_is_written_out_before_anything_is_added() -> None:
    """Found by probing: headers, content and a description were written beside the `$ref`,
    which OpenAPI forbids (and tools ignore); the 409's description began with " / "."""
    for version in ("3.0.3", "3.1.0"):
        schema = _referencing_schema(version)
        validate(schema)
        for reference in _references(schema):
            assert list(reference) == ["$ref"], reference
        responses = schema["paths"]["/things"]["post"]["responses"]
        assert sorted(responses["201"]["headers"]) == ["Idempotent-Replayed", "X-Id"]
        assert responses["201"]["description"] == "made"
        assert "Idempotent-Replayed" in responses["200"]["headers"]  # through two references
        assert responses["409"]["description"].startswith("conflict / `urn:")
        assert "Retry-After" in responses["409"]["headers"]
        # The components, which other operations may use, are left as they were.
        assert "headers" not in schema["components"]["responses"]["Conflict"]
        assert sorted(schema["components"]["responses"]["Created"]["headers"]) == ["X-Id"]
        for status, response in responses.items():
            description = response.get("description", "")
            assert not description.startswith((" ", "/")), status


def test_another_documents_response_is_left_as_the_app_wrote_it() -> None:
    """It cannot be merged into, and nothing may stand beside its `$ref`."""
    responses = _referencing_schema("3.1.0", _elsewhere)["paths"]["/things"]["post"]["responses"]
    assert responses["201"] == {"$ref": "shared.yaml#/components/responses/Created"}
    assert responses["409"] == {"$ref": "shared.yaml#/components/responses/Conflict"}
    assert "400" in responses  # the statuses the app does not document are still added


def test_a_response_without_a_description_gets_the_middlewares_alone() -> None:
    """Joined with " / ", the 409's description began with the separator."""
    app = Starlette(
        routes=[Route("/things", _create, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy())
        ],
    )
    bare = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    schema = {"openapi": "3.1.0", "paths": {"/things": {"post": {"responses": {"409": bare}}}}}
    conflict = document_openapi(schema, app)["paths"]["/things"]["post"]["responses"]["409"]
    assert conflict["description"].startswith("`urn:"), conflict["description"]
    assert sorted(conflict["content"]) == ["application/problem+json", "text/plain"]


def test_the_apps_key_parameter_given_as_a_ref_is_replaced_not_repeated() -> None:
    """Found beside the `$ref` responses: a `$ref` to the app's own Idempotency-Key parameter
    was kept next to the middleware's, a duplicate parameter (invalid)."""
    app = Starlette(
        routes=[Route("/things", _create, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy())
        ],
    )
    key = {"name": "idempotency-key", "in": "header", "schema": {"type": "string"}}
    trace = {"name": "traceparent", "in": "header", "schema": {"type": "string"}}
    schema = {
        "openapi": "3.1.0",
        "info": {"title": "t", "version": "1"},
        "components": {"parameters": {"Key": key, "Trace": trace}},
        "paths": {
            "/things": {
                "post": {
                    "parameters": [
                        {"$ref": "#/components/parameters/Key"},
                        {"$ref": "#/components/parameters/Trace"},
                    ],
                    "responses": {"201": {"description": "made"}},
                }
            }
        },
    }
    validate(schema)
    documented = document_openapi(schema, app)
    validate(documented)
    parameters = documented["paths"]["/things"]["post"]["parameters"]
    assert parameters[0] == {"$ref": "#/components/parameters/Trace"}
    assert [p.get("name") for p in parameters[1:]] == ["Idempotency-Key"]
