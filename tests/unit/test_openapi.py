"""OpenAPI: guarded operations document the header and the problem responses; others do not."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.schemas import SchemaGenerator

from example_app.app import create_app
from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy, idempotent
from idem_middleware.openapi import PROBLEM_SCHEMA, _retention, document_openapi

GUARDED = [("/accounts/{account_id}/credits", "post"), ("/payouts", "post")]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    app = create_app("postgresql://unused@/unused")  # building the schema opens no connection
    spec: dict[str, Any] = app.openapi()
    return spec


def _header(operation: dict[str, Any]) -> dict[str, Any] | None:
    for p in operation.get("parameters", []):
        if p["in"] == "header" and p["name"] == "Idempotency-Key":
            return p
    return None


def test_the_example_schema_is_valid_openapi(schema: dict[str, Any]) -> None:
    validate(schema)


@pytest.mark.parametrize(("path", "method"), GUARDED)
def test_guarded_operations_document_header_and_problems(
    schema: dict[str, Any], path: str, method: str
) -> None:
    operation = schema["paths"][path][method]
    header = _header(operation)
    assert header is not None
    assert header["required"] is True
    assert "1 day" in header["description"]  # the retention window
    responses = operation["responses"]
    ref = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}
    for status in ("400", "409"):
        assert responses[status]["content"]["application/problem+json"]["schema"] == ref
    # (422: the app documents its validation problem there too; either, see below.)
    assert ref in responses["422"]["content"]["application/problem+json"]["schema"]["anyOf"]
    assert "Retry-After" in responses["409"]["headers"]
    assert "Idempotent-Replayed" in responses["201"]["headers"]
    assert "202" not in responses  # the example's routes answer 409, not 202
    problem = schema["components"]["schemas"][PROBLEM_SCHEMA]
    assert set(problem["required"]) == {"type", "title", "status"}


def test_unguarded_operations_are_left_alone(schema: dict[str, Any]) -> None:
    operation = schema["paths"]["/accounts/{account_id}"]["get"]
    assert _header(operation) is None
    assert "409" not in operation["responses"]


def test_optional_key_and_202_are_documented() -> None:
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    app = FastAPI()
    install(app, store=MemoryStore())

    @app.post("/maybe")
    @idempotent(key_required=False, accept_while_in_flight=True, retention_seconds=3600 * 6)
    async def maybe() -> dict[str, str]:
        return {}

    operation = app.openapi()["paths"]["/maybe"]["post"]
    header = _header(operation)
    assert header is not None
    assert header["required"] is False
    assert "6 hours" in header["description"]
    assert "Location" in operation["responses"]["202"]["headers"]
    validate(app.openapi())


def test_a_token_operation_is_documented_under_its_pinned_name() -> None:
    """The client asks the token route for the name the records are kept under: a token for
    the template's name is refused."""
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    app = FastAPI()
    install(app, store=MemoryStore())

    @app.post("/v2/pay")
    @idempotent(require_token=True, operation="POST /payments")
    async def pay() -> dict[str, str]:
        return {}

    header = _header(app.openapi()["paths"]["/v2/pay"]["post"])
    assert header is not None
    assert '`{"operation": "POST /payments"}`' in header["description"]


def test_starlette_schema_generator_helper() -> None:
    async def create(request: Request) -> JSONResponse:
        """
        responses:
          201:
            description: Created.
        """
        return JSONResponse({}, status_code=201)

    async def read(request: Request) -> JSONResponse:
        """
        responses:
          200:
            description: The thing.
        """
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/things", create, methods=["POST"]),
            Route("/things", read, methods=["GET"]),
        ],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy())
        ],
    )
    generator = SchemaGenerator({"openapi": "3.0.0", "info": {"title": "things", "version": "1"}})
    schema = document_openapi(generator.get_schema(routes=app.routes), app)
    assert _header(schema["paths"]["/things"]["post"]) is not None
    assert _header(schema["paths"]["/things"]["get"]) is None
    assert "422" in schema["paths"]["/things"]["post"]["responses"]
    validate(schema)


def _keyed_app(**middleware: Any) -> Any:
    from fastapi import FastAPI

    from idem_middleware import KeyFromBody, KeyFromHeader
    from idem_middleware.fastapi import install

    app = FastAPI()
    install(app, store=MemoryStore(), **middleware)

    @app.post("/header")
    async def header() -> dict[str, str]:
        return {}

    @app.post("/webhook-header", description="Receives webhooks.")
    @idempotent(key_source=KeyFromHeader("X-Webhook-Id"))
    async def webhook_header() -> dict[str, str]:
        return {}

    @app.post("/webhook-body")
    @idempotent(key_source=KeyFromBody("/event/id"), allow_anonymous=True)
    async def webhook_body() -> dict[str, str]:
        return {}

    @app.post("/computed")
    @idempotent(key_source=lambda scope, body: None, require_token=True)
    async def computed() -> dict[str, str]:
        return {}

    return app


def _problem_types(operation: dict[str, Any], status: str) -> str:
    return str(operation["responses"].get(status, {}).get("description", ""))


def test_every_problem_kind_a_guarded_operation_can_answer_is_documented() -> None:
    from idem_middleware.errors import ProblemKind
    from idem_middleware.responses import problem_status

    base = "https://errors.example/"
    schema = _keyed_app(max_tenant_connections=4, problem_base=base).openapi()
    validate(schema)
    operation = schema["paths"]["/header"]["post"]
    for kind in ProblemKind:
        if kind in (
            ProblemKind.RECORD_NOT_FOUND,
            ProblemKind.TOKEN_CONFLICT,
            ProblemKind.METHOD_NOT_ALLOWED,
            ProblemKind.TOKEN_INVALID,
            ProblemKind.OPERATION_INVALID,
        ):
            # the library's own routes only; tokens only where a policy requires them; an
            # operation only where the request names it itself (never a route's template)
            continue
        assert f"`{base}{kind.value}`" in _problem_types(operation, str(problem_status(kind))), kind
    assert "Retry-After" in operation["responses"]["429"]["headers"]  # tenant-busy
    assert "Retry-After" in operation["responses"]["503"]["headers"]
    assert "too-many-fields" in _problem_types(operation, "400")
    assert "server-misconfigured" in _problem_types(operation, "500")
    assert "token-invalid" not in _problem_types(operation, "400")
    assert "operation-invalid" not in _problem_types(operation, "400")
    assert "token-invalid" in _problem_types(schema["paths"]["/computed"]["post"], "400")
    # Anonymous callers allowed: never a 401.
    assert "401" not in schema["paths"]["/webhook-body"]["post"]["responses"]


def test_tenant_busy_is_documented_only_with_a_per_tenant_cap() -> None:
    operation = _keyed_app().openapi()["paths"]["/header"]["post"]
    assert "429" not in operation["responses"]


def test_the_key_parameter_follows_the_key_source() -> None:
    schema = _keyed_app().openapi()
    validate(schema)
    paths = schema["paths"]

    def headers(path: str) -> list[str]:
        parameters = paths[path]["post"].get("parameters", [])
        return [p["name"] for p in parameters if p["in"] == "header"]

    assert headers("/header") == ["Idempotency-Key"]
    assert headers("/webhook-header") == ["X-Webhook-Id"]
    assert paths["/webhook-header"]["post"]["description"] == "Receives webhooks."
    assert headers("/webhook-body") == []
    assert "/event/id" in paths["/webhook-body"]["post"]["description"]
    assert headers("/computed") == []
    assert "the key is taken from the request" in paths["/computed"]["post"]["description"]


def test_retry_after_is_added_to_the_headers_an_app_documents() -> None:
    """Found by probing: the Retry-After documentation replaced the app's own headers."""
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    app = FastAPI()
    conflict = {"description": "mine", "headers": {"X-Conflict-Id": {"schema": {"type": "string"}}}}

    @app.post("/orders", status_code=201, responses={409: conflict})
    async def orders() -> dict[str, str]:
        return {}

    install(app, store=MemoryStore())
    headers = app.openapi()["paths"]["/orders"]["post"]["responses"]["409"]["headers"]
    assert sorted(headers) == ["Retry-After", "X-Conflict-Id"]


# --- found by probing the example app's contract ------------------------------------------


@given(
    st.one_of(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=260),
        st.text(st.sampled_from('a"\\ !~'), max_size=260).map(lambda s: f'"{s}"'),
        st.just('"' + "\\\\" * 255 + '"'),  # the longest valid value: 255 escaped characters
    ).filter(lambda v: v == v.strip(" "))  # HTTP servers strip the whitespace around values
)
@settings(max_examples=400, deadline=None)
def test_the_key_schema_admits_exactly_the_header_values_the_parser_accepts(value: str) -> None:
    """The header was documented with maxLength 257, but 255 escaped characters are 512."""
    from idem_middleware.errors import RequestRejected
    from idem_middleware.keys import parse_key_value
    from idem_middleware.openapi import header_parameter

    schema = header_parameter(Policy())["schema"]
    try:
        parse_key_value(value.encode("ascii"))
        accepted = True
    except RequestRejected:
        accepted = False
    documented = bool(re.fullmatch(schema["pattern"], value)) and (
        schema["minLength"] <= len(value) <= schema["maxLength"]
    )
    assert documented == accepted, value


async def test_the_202_documents_the_body_and_headers_it_sends() -> None:
    from fastapi import FastAPI

    from idem_middleware.fastapi import install
    from idem_middleware.responses import send_accepted

    app = FastAPI()
    install(app, store=MemoryStore())

    @app.post("/jobs")
    @idempotent(accept_while_in_flight=True)
    async def jobs() -> dict[str, str]:
        return {}

    documented = app.openapi()["paths"]["/jobs"]["post"]["responses"]["202"]
    validate(app.openapi())
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await send_accepted(send, "/idempotency/status?key=k", 2)
    headers = {name.decode().lower() for name, _ in sent[0]["headers"]}
    assert headers - {"content-type", "content-length"} == {
        name.lower() for name in documented["headers"]
    }
    content_type = dict(sent[0]["headers"])[b"content-type"].decode()
    jsonschema.validate(json.loads(sent[1]["body"]), documented["content"][content_type]["schema"])


def test_stored_refusals_are_documented_as_replayed() -> None:
    """A 402 (failed_final) is replayed with Idempotent-Replayed like a 2xx; a 404 or a 5xx
    never is (released, or not stored)."""
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    app = FastAPI()
    install(app, store=MemoryStore())

    @app.post(
        "/pay",
        status_code=201,
        responses={402: {"description": "declined"}, 404: {}, 502: {}, "4XX": {}, "default": {}},
    )
    async def pay() -> dict[str, str]:
        return {}

    responses = app.openapi()["paths"]["/pay"]["post"]["responses"]
    replayed = {
        status for status, r in responses.items() if "Idempotent-Replayed" in r.get("headers", {})
    }
    assert replayed == {"201", "402", "4XX"}


async def test_a_mounted_fastapi_app_documents_what_the_parent_guards() -> None:
    """The parent's middleware guards the sub-app's POST, but the sub-app's own /openapi.json
    (its /docs) said nothing of the required key. Mounted after install, as usual."""
    import httpx
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    app = FastAPI()
    install(app, store=MemoryStore(), default_policy=Policy(allow_anonymous=True))

    @app.post("/top")
    async def top() -> dict[str, str]:
        return {}

    sub = FastAPI()

    @sub.post("/orders/{order_id}")
    async def order(order_id: int) -> dict[str, str]:
        return {}

    @sub.get("/orders")
    async def orders() -> list[str]:
        return []

    app.mount("/v{version:int}", sub)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        refused = await client.post("/v2/orders/1")
        spec = (await client.get("/v2/openapi.json")).json()
        parent = (await client.get("/openapi.json")).json()
    assert refused.status_code == 400  # guarded: the key is missing
    validate(spec)
    assert _header(spec["paths"]["/orders/{order_id}"]["post"]) is not None
    assert _header(spec["paths"]["/orders"]["get"]) is None
    assert _header(parent["paths"]["/top"]["post"]) is not None
    assert "/v{version}/orders/{order_id}" not in parent["paths"]


def test_a_schema_built_before_install_is_documented() -> None:
    from fastapi import FastAPI

    from idem_middleware.fastapi import install

    app = FastAPI()

    @app.post("/x")
    async def x() -> dict[str, str]:
        return {}

    app.openapi()  # cached by FastAPI, before the middleware was installed
    install(app, store=MemoryStore())
    assert _header(app.openapi()["paths"]["/x"]["post"]) is not None


def test_the_example_documents_its_own_problems_as_it_sends_them(schema: dict[str, Any]) -> None:
    """Found by probing: the app's 402/404/502 were documented as application/json with the
    Problem schema, and application/problem+json with none; it sends only the latter."""
    for path, method, status in [
        ("/payouts", "post", "402"),
        ("/payouts", "post", "502"),
        ("/accounts/{account_id}", "get", "404"),
        ("/accounts/{account_id}", "get", "503"),
    ]:
        content = schema["paths"][path][method]["responses"][status]["content"]
        assert list(content) == ["application/problem+json"], (path, status)
        assert set(content["application/problem+json"]["schema"]["required"]) == {
            "type",
            "title",
            "status",
        }
    assert (
        "Retry-After"
        in schema["paths"]["/accounts/{account_id}"]["get"]["responses"]["503"]["headers"]
    )


def test_the_examples_validation_422_is_documented_as_the_problem_it_sends(
    schema: dict[str, Any],
) -> None:
    """FastAPI documented (and sent) its validation 422 as application/json `{"detail": ...}`;
    the example sends a problem with `errors`, and where the middleware can also answer 422 (a
    reused key) either problem is documented, the app's own schema kept."""
    for path, method in [
        ("/accounts/{account_id}/credits", "post"),
        ("/payouts", "post"),
        ("/accounts/{account_id}", "get"),
    ]:
        content = schema["paths"][path][method]["responses"]["422"]["content"]
        assert list(content) == ["application/problem+json"], path
        shape = content["application/problem+json"]["schema"]
        shapes = shape.get("anyOf", [shape])
        own = [s for s in shapes if "errors" in s.get("properties", {})]
        assert len(own) == 1, (path, shape)
        assert own[0]["properties"]["errors"]["items"]["required"] == ["loc", "msg", "type"]
        assert "$defs" not in json.dumps(shape), path  # (written in place: no dangling refs)
        guarded = method == "post"
        assert ({"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"} in shapes) == guarded, path


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (1_234_567, "1,234,567 seconds"),  # (was "1.23457e+06 seconds": 3 s off, in a float's form)
        (30 * 86400 + 1, "2,592,001 seconds"),
        (3600, "1 hour"),  # (was "1 hours")
        (7200, "2 hours"),
        (172_800, "2 days"),
        (1.5, "1.5 seconds"),
    ],
)
def test_the_retention_is_said_exactly_in_the_largest_whole_unit(seconds: float, said: str) -> None:
    """Found by probing: a retention that is no whole number of hours was shown rounded to six
    digits, in scientific notation."""
    assert _retention(seconds) == said
