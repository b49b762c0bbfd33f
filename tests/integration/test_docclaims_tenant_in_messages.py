"""docs/security.md and docs/observability.md: the tenant is logged only as the `tenant` field of
a record's `extra`, never in a message (a filter that hashes `record.tenant`, as observability.md
shows, then keeps it out of the logs). The lines naming a damaged record (a stored status no
server sends, stored headers the library never writes) put it in the message."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Policy
from idem_middleware.context import key_digest
from tests.apps import assert_problem, key
from tests.apps.clients import client, one_route_app

PATH = "/charges"
OPERATION = f"POST {PATH}"
KEY = "docclaims-key-1"
TENANT = "alice.personal@example.com"
HEADERS = {**key(KEY), "content-type": "application/json"}


def _app(store: Any) -> Any:
    async def charge(request: Request) -> Response:
        await request.body()
        return JSONResponse({"ok": True}, 201)

    return one_route_app(
        PATH,
        charge,
        store=store,
        policies={OPERATION: Policy()},
        tenant_resolver=lambda scope: TENANT,
    )


def _the_record_named_without_its_tenant(caplog: pytest.LogCaptureFixture, level: int) -> None:
    said = [r for r in caplog.records if r.levelno >= level and OPERATION in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    for record in said:
        assert key_digest(KEY) in record.getMessage()
        assert TENANT not in record.getMessage(), record.getMessage()
        assert getattr(record, "tenant", None) == TENANT  # (where an operator finds it)


@pytest.mark.parametrize(
    ("column", "value", "level"),
    [
        ("response_status", 1000, logging.ERROR),
        ("response_headers", "not json", logging.WARNING),
    ],
)
async def test_a_damaged_records_log_line_keeps_the_tenant_out_of_its_message(
    pg_store: Any, pool: Any, caplog: pytest.LogCaptureFixture, column: str, value: Any, level: int
) -> None:
    app = _app(pg_store)
    async with client(app) as c:
        first = await c.post(PATH, content=b"{}", headers=HEADERS)
        assert first.status_code == 201, first.text
        if column == "response_status":
            await pool.execute("UPDATE idem_requests SET response_status = $1", value)
        else:
            await pool.execute(
                "UPDATE idem_requests SET response_headers = convert_to($1, 'UTF8')", value
            )
        caplog.set_level(logging.WARNING)
        retry = await c.post(PATH, content=b"{}", headers=HEADERS)
    if column == "response_status":
        assert_problem(retry, 500, "server-misconfigured")
    else:
        assert retry.status_code == 201
        assert retry.headers["idempotent-replayed"] == "true"
    _the_record_named_without_its_tenant(caplog, level)
