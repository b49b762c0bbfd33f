"""`document_openapi` on a schema whose `$ref`s go round in a circle (a component naming itself,
or two naming each other: a mistake in a hand-written document) returns, leaving them as they
are; it never follows them for ever (the app's startup, or its /openapi.json, would hang)."""

from __future__ import annotations

import threading
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.openapi import document_openapi


async def _create(request: Request) -> Response:
    return Response(status_code=201)


def test_a_circle_of_references_is_left_as_it_is() -> None:
    app = Starlette(
        routes=[Route("/things", _create, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy())
        ],
    )
    loop = {"$ref": "#/components/parameters/Loop"}
    schema = {
        "openapi": "3.1.0",
        "info": {"title": "t", "version": "1"},
        "components": {
            "parameters": {"Loop": {"$ref": "#/components/parameters/Other"}, "Other": loop}
        },
        "paths": {
            "/things": {
                "post": {"parameters": [dict(loop)], "responses": {"201": {"description": "made"}}}
            }
        },
    }
    done: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: done.append(document_openapi(schema, app)))
    worker.daemon = True  # (a mutant looping for ever must not hold the run)
    worker.start()
    worker.join(10)
    assert done, "document_openapi followed a circle of $refs for ever"
    parameters = done[0]["paths"]["/things"]["post"]["parameters"]
    assert parameters[0] == loop
    assert [p.get("name") for p in parameters[1:]] == ["Idempotency-Key"]
