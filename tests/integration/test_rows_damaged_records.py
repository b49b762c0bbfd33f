"""Records the library did not write as they are: edited by a DBA with SQL, written by an older
version, or damaged. A retry of their request must never be a response a server refuses (a
dropped connection for the whole retention) nor the server's bare 500 from a traceback: it gets
the outcome (what of it can be sent), or a 500 problem+json with a log naming the record; the
status resource answers, never a traceback."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext, Mode, Policy
from idem_middleware.context import key_digest
from idem_middleware.jobs import idempotent_job
from idem_middleware.sendable import head_problem
from idem_middleware.status import status_route
from tests.apps import BOUND, assert_problem, key
from tests.apps.clients import AsServer, asgi_request, client, one_route_app

PATH = "/charges"
OPERATION = f"POST {PATH}"
BODY = b'{"amount": 5}'
KEY = "raw-secret-key-1"
_HEADERS = {**key(KEY), "content-type": "application/json"}  # (as `asgi_request` sends it)


def _app(store: Any, mode: Mode = Mode.TRANSACTIONAL) -> Any:
    calls: list[int] = []

    async def charge(request: Request) -> Response:
        calls.append(1)
        return JSONResponse({"call": len(calls)}, 201, headers={"location": "/charges/1"})

    app = one_route_app(PATH, charge, store=store, policies={OPERATION: Policy(mode=mode)})
    app.router.routes.append(status_route(store))
    app.state.calls = calls
    return app


async def _first(app: Any) -> None:
    async with client(app) as c:
        first = await c.post(PATH, content=BODY, headers=_HEADERS)
    assert first.status_code == 201, first.text


async def _retry(app: Any) -> AsServer:
    """The retry, driven as a server drives the app: what it sent, each message."""
    server = AsServer(BODY)
    await asyncio.wait_for(
        app(asgi_request(PATH, KEY, len(BODY)), server.receive, server.send), BOUND
    )
    return server


def _head(server: AsServer) -> tuple[int, list[tuple[bytes, bytes]]]:
    [start] = [m for m in server.sent if m["type"] == "http.response.start"]
    # What the servers the library is tested behind send (sendable.py): else the retry's
    # connection is dropped.
    assert head_problem(start["status"], start["headers"]) is None, start
    return start["status"], start["headers"]


async def _status_resource(app: Any) -> httpx.Response:
    async with client(app) as c:
        return await c.get("/idempotency/status", params={"operation": OPERATION, "key": KEY})


def _names_the_record(caplog: pytest.LogCaptureFixture, level: int) -> None:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= level]
    assert any(key_digest(KEY) in line and OPERATION in line for line in lines), lines
    assert not any(KEY in line for line in lines), lines  # (never the raw key)


@pytest.mark.parametrize(
    "stored",
    [
        "not json",
        "[[1, 2]]",  # (an AttributeError)
        '[["x-a", "b", "c"]]',  # (a ValueError)
        '[["x-a", "\u6771\u4eac"]]',  # (no Latin-1: a UnicodeEncodeError)
        "null",  # (a TypeError)
        '{"ab": "c"}',  # (its keys were taken for pairs of letters: `a: c`... `a: b`)
        '["ab"]',  # (a pair's letters were taken for a name and a value: `a: b`)
        '[{"a": "1", "b": "2"}]',  # (an object's keys were taken for a pair: `a: b`)
        '[["x-a", "b", "c"], "ab"]',  # (and among those left out after another error)
    ],
)
async def test_headers_the_library_never_wrote_are_left_out_and_the_outcome_replayed(
    pg_store: Any, pool: Any, stored: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, decoding them raised from the store's read: every retry, and the status
    resource, got the server's bare `500 Internal Server Error` (text/plain) for the retention."""
    app = _app(pg_store)
    await _first(app)
    await pool.execute("UPDATE idem_requests SET response_headers = convert_to($1, 'UTF8')", stored)
    caplog.set_level(logging.WARNING)
    retry = await _retry(app)
    status, headers = _head(retry)
    assert status == 201
    assert retry.sent_body() == b'{"call":1}'
    assert (b"idempotent-replayed", b"true") in headers
    assert b"a" not in [name for name, _ in headers]
    assert app.state.calls == [1]
    _names_the_record(caplog, logging.WARNING)

    answer = await _status_resource(app)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["state"], answer.json()["response_status"]) == ("succeeded", 201)


async def test_framing_and_hop_by_hop_headers_stored_by_hand_are_not_replayed(
    pg_store: Any, pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, they were replayed beside the replay's own Content-Length: two that disagree
    (h11 refused the head, the connection dropped; httptools sent both), Transfer-Encoding with
    a Content-Length (a response a proxy may read either way), and Connection/Upgrade."""
    app = _app(pg_store)
    await _first(app)
    await pool.execute(
        "UPDATE idem_requests SET response_headers = convert_to($1, 'UTF8')",
        '[["content-length", "999"], ["transfer-encoding", "chunked"], ["x-kept", "1"], '
        '["connection", "close, x-listed"], ["x-listed", "2"], ["upgrade", "h2c"], '
        '["idempotent-replayed", "false"]]',
    )
    caplog.set_level(logging.WARNING)
    retry = await _retry(app)
    status, headers = _head(retry)
    assert status == 201
    assert retry.sent_body() == b'{"call":1}'
    assert headers == [
        (b"x-kept", b"1"),
        (b"content-length", b"10"),
        (b"idempotent-replayed", b"true"),
    ]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(OPERATION in m and "a replay never repeats" in m for m in said), said


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("stored", [0, 99, 101, 199, 600, 1000, -1])
async def test_a_stored_status_no_server_sends_is_a_500_problem_naming_the_record(
    pg_store: Any, pool: Any, stored: int, mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, it was replayed as it was: uvicorn (h11 and httptools) dropped the connection of
    every retry, for the whole retention, and nothing said which record."""
    app = _app(pg_store, mode)
    await _first(app)
    await pool.execute("UPDATE idem_requests SET response_status = $1", stored)
    caplog.set_level(logging.ERROR)
    for _ in range(2):  # (nothing moved: the same answer again)
        async with client(app) as c:
            retry = await c.post(PATH, content=BODY, headers=_HEADERS)
        assert_problem(retry, 500, "server-misconfigured")
        assert "idempotent-replayed" not in retry.headers
    assert app.state.calls == [1]  # (never run again: its outcome is recorded)
    _names_the_record(caplog, logging.ERROR)
    assert any(f"the status {stored}," in r.getMessage() for r in caplog.records)

    # An operator's fix is replayed from then on.
    await pool.execute("UPDATE idem_requests SET response_status = 201")
    retry = await _retry(app)
    assert _head(retry)[0] == 201


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("stored", [200, 599])
async def test_a_stored_status_at_either_end_of_what_servers_send_is_replayed(
    pg_store: Any, pool: Any, stored: int, mode: Mode
) -> None:
    app = _app(pg_store, mode)
    await _first(app)
    await pool.execute("UPDATE idem_requests SET response_status = $1", stored)
    retry = await _retry(app)
    status, headers = _head(retry)
    assert status == stored
    assert (b"idempotent-replayed", b"true") in headers
    assert app.state.calls == [1]


async def test_a_job_reads_the_body_of_a_record_whatever_its_status(
    pg_store: Any, pool: Any
) -> None:
    """(Jobs are no HTTP: the status check of replays leaves them alone.)"""

    runs: list[int] = []

    @idempotent_job(pg_store, operation="job:rows", key=lambda n: f"n-{n}", tenant="t")
    async def job(ctx: IdempotencyContext, n: int) -> dict[str, int]:
        runs.append(n)
        return {"n": n}

    assert await job(1) == {"n": 1}
    await pool.execute("UPDATE idem_requests SET response_status = 0")
    assert await job(1) == {"n": 1}
    assert runs == [1]


async def test_a_stored_body_omitted_no_header_can_hold_is_replayed_as_a_plain_one(
    pg_store: Any, pool: Any
) -> None:
    """Before, its line break went into the replay's Idempotency-Body-Omitted: a head both
    servers refuse (the connection dropped), for every retry."""
    app = _app(pg_store)
    await _first(app)
    await pool.execute("UPDATE idem_requests SET body_omitted = E'too\\r\\nlarge '")
    retry = await _retry(app)
    status, headers = _head(retry)
    assert status == 201
    assert retry.sent_body() == b""
    assert (b"idempotency-body-omitted", b"omitted") in headers
