"""An outage's log: every request that meets a store failure logs its line, with its tenant,
operation and key digest, but only the first of each kind (the error's class and its cause's) in
`TRACEBACK_EVERY_SECONDS` logs its traceback. (Before: a traceback per request, about 1,800 in a
10 s database restart under a soak's traffic.)"""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import PostgresStore, errors
from tests.apps import BOUND, assert_problem, client, key, one_route_app

DEADLINE = 0.2


async def _ok(request: Request) -> Response:
    return JSONResponse({}, status_code=201)


def _failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "idempotency store unavailable"]


async def test_an_outage_logs_one_traceback_per_kind_a_minute_and_a_line_per_request(
    db_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False) as store:
        app = one_route_app("/x", _ok, store=store, acquire_timeout=DEADLINE)
        held = await store.pool.acquire()  # the pool's only connection: every claim times out
        try:
            async with client(app) as http:
                for i in range(4):
                    reply = await asyncio.wait_for(
                        http.post("/x", json={}, headers=key(f"k{i}")), BOUND
                    )
                    assert_problem(reply, 503, "store-unavailable")
                failures = _failures(caplog)
                assert len(failures) == 4  # a line for each request, each naming its own
                assert len({getattr(r, "key_digest", None) for r in failures}) == 4
                assert all(getattr(r, "tenant", None) for r in failures)
                assert [bool(r.exc_info) for r in failures] == [True, False, False, False]

                # The minute over (made instant): the next failure of the kind has its own.
                monkeypatch.setattr(errors, "TRACEBACK_EVERY_SECONDS", 0.0)
                reply = await asyncio.wait_for(http.post("/x", json={}, headers=key("k9")), BOUND)
                assert_problem(reply, 503, "store-unavailable")
                assert _failures(caplog)[-1].exc_info
        finally:
            await store.pool.release(held)


async def test_another_kind_of_failure_logs_its_own_traceback_within_the_minute(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    store = await PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False).open()
    app = one_route_app("/x", _ok, store=store, acquire_timeout=DEADLINE)
    async with client(app) as http:
        held = await store.pool.acquire()
        try:
            reply = await asyncio.wait_for(http.post("/x", json={}, headers=key("a")), BOUND)
            assert_problem(reply, 503, "store-unavailable")  # a checkout that timed out
        finally:
            await store.pool.release(held)
        await store.close()  # then a store that is closed: another kind
        for name in ("b", "c"):
            reply = await asyncio.wait_for(http.post("/x", json={}, headers=key(name)), BOUND)
            assert_problem(reply, 503, "store-unavailable")
    kinds = [(type(r.exc_info[1]).__name__ if r.exc_info else None) for r in _failures(caplog)]
    assert kinds == ["StoreError", "StoreClosed", None], kinds
