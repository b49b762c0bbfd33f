"""LoggingObserver's `operation` field, for an operation named by the concrete path a request
took (a sub-app mounted behind a wrapper the router above cannot see into): found by probing,
it was the client's path as the server decoded it, whole, in every INFO line of the request
(claimed, succeeded...). A `%0D%0A` was a line break in the field (a text formatter naming
`%(operation)s` wrote a line of the client's), and a kilobyte's path (the longest operation
a record holds) a kilobyte more in each line.
The message's operations, the span attributes and the metric labels were escaped and bounded
already; the field now is too (as a log message shows it: `observe.shown`)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.observe import SHOWN_CHARS, LoggingObserver
from tests.apps import client


async def pay(request: Request) -> Response:
    await request.body()
    return PlainTextResponse("paid", 201)


def app_behind_a_wrapper() -> Starlette:
    inner = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "tenant-a",
                observers=[LoggingObserver()],
            )
        ],
    )

    async def hiding(scope: Any, receive: Any, send: Any) -> None:  # no `.app` to look into
        await inner(scope, receive, send)

    return Starlette(routes=[Mount("/w/{name}", app=hiding)])


@pytest.mark.parametrize(
    "value",
    ["x%0D%0AINFO forged line", "x%1B%5B31mred", "x" * 1000, "plain"],
    ids=["crlf", "ansi", "long", "plain"],
)
async def test_the_operation_field_is_escaped_and_bounded(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idem_middleware")
    async with client(app_behind_a_wrapper()) as c:
        for _ in range(2):  # a claim, then a replay
            reply = await c.post(f"/w/{value}/pay", json={}, headers={"idempotency-key": "k1"})
            assert reply.status_code == 201, reply.text
    decisions = [r for r in caplog.records if r.getMessage().startswith("idempotency ")]
    assert [r.getMessage() for r in decisions] == [
        "idempotency claimed",
        "idempotency succeeded",
        "idempotency replayed",
    ]
    for record in decisions:
        operation = record.operation  # type: ignore[attr-defined]
        assert operation.isprintable(), operation
        assert len(operation) < SHOWN_CHARS + 50, len(operation)
    if value == "plain":  # (a printable, short operation is as it was)
        assert decisions[0].operation == "POST /w/plain/pay"  # type: ignore[attr-defined]
