"""A duplicate of a request running in this process, with its tenant's slots all taken
(`max_tenant_connections`), is a duplicate in both modes: it waits for the original (holding no
slot and no connection), then is answered the replay, or `409`/`202` at the end of its wait.

Found by probing: in transactional mode it waited and was replayed, but in lease mode it was
answered `429 tenant-busy` at once, its client told to retry a request that was running (a lease
execution was not among the keys `Waiters.held` names). A fresh key of a tenant at its cap is
still refused at once, in both modes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from idem_middleware import Mode, Policy
from tests.apps import (
    BOUND,
    assert_problem,
    client,
    idempotency_middleware,
    key,
    one_route_app,
    until,
    wait_for_waiters,
)

MODES = ["transactional", "lease"]


class Gated:
    """`POST /pay`: each run waits for `gate`; `ending` says how it ends."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.runs = 0
        self.ending = "response"

    async def pay(self, request: Request) -> Response:
        await request.body()
        self.runs += 1
        self.entered.set()
        if self.ending == "stream":
            return StreamingResponse(self._stream(), 201, media_type="text/event-stream")
        await self.gate.wait()
        if self.ending == "error":
            raise RuntimeError("the handler failed")
        return JSONResponse({"run": self.runs}, status_code=201)

    async def _stream(self) -> Any:
        yield b"first "
        await self.gate.wait()
        yield b"last"


def _policy(mode: str, **options: Any) -> Policy:
    if mode == "lease":
        options.update(mode=Mode.LEASE, lease_seconds=30.0)
    return Policy(**options)


def _app(store: Any, mode: str, gated: Gated, **options: Any) -> Any:
    return one_route_app(
        "/pay",
        gated.pay,
        store=store,
        default_policy=_policy(mode, **options),
        max_tenant_connections=1,
    )


@pytest.mark.parametrize("mode", MODES)
async def test_a_duplicate_at_the_tenants_cap_waits_for_the_replay(store: Any, mode: str) -> None:
    gated = Gated()
    app = _app(store, mode, gated, wait_seconds=10)
    async with client(app) as http:
        first = asyncio.ensure_future(http.post("/pay", json={"a": 1}, headers=key("k")))
        try:
            await asyncio.wait_for(gated.entered.wait(), BOUND)
            duplicate = asyncio.ensure_future(http.post("/pay", json={"a": 1}, headers=key("k")))
            await wait_for_waiters(app, 1)
            assert not duplicate.done()
            # A fresh key of the tenant's is refused at once, as before.
            fresh = await asyncio.wait_for(
                http.post("/pay", json={"a": 1}, headers=key("other")), BOUND
            )
            assert_problem(fresh, 429, "tenant-busy")
        finally:
            gated.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(first, duplicate), BOUND)
    assert [a.status_code for a in answers] == [201, 201], answers[1].text
    assert answers[1].headers.get("idempotent-replayed") == "true"
    assert answers[1].json() == answers[0].json()
    assert gated.runs == 1
    mw = idempotency_middleware(app)
    assert mw.waiters.held == {}
    assert mw.waiters.count == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_duplicate_at_the_cap_is_answered_in_flight_at_the_end_of_its_wait(
    store: Any, mode: str
) -> None:
    gated = Gated()
    app = _app(store, mode, gated, wait_seconds=0.3)
    async with client(app) as http:
        first = asyncio.ensure_future(http.post("/pay", json={"a": 1}, headers=key("k")))
        try:
            await asyncio.wait_for(gated.entered.wait(), BOUND)
            duplicate = await asyncio.wait_for(
                http.post("/pay", json={"a": 1}, headers=key("k")), BOUND
            )
        finally:
            gated.gate.set()
        assert (await asyncio.wait_for(first, BOUND)).status_code == 201
    assert_problem(duplicate, 409, "request-in-flight")
    assert gated.runs == 1


@pytest.mark.parametrize("mode", MODES)
async def test_a_duplicate_of_another_body_at_the_cap_is_told_so(store: Any, mode: str) -> None:
    """The same key with another body, while the original runs: after the wait, `422`."""
    gated = Gated()
    app = _app(store, mode, gated, wait_seconds=10)
    async with client(app) as http:
        first = asyncio.ensure_future(http.post("/pay", json={"a": 1}, headers=key("k")))
        try:
            await asyncio.wait_for(gated.entered.wait(), BOUND)
            other = asyncio.ensure_future(http.post("/pay", json={"a": 2}, headers=key("k")))
            await wait_for_waiters(app, 1)
        finally:
            gated.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(first, other), BOUND)
    assert answers[0].status_code == 201
    assert_problem(answers[1], 422, "key-reused")
    assert gated.runs == 1


@pytest.mark.parametrize("ending", ["response", "error", "cancelled", "stream"])
async def test_no_lease_key_stays_held_after_its_execution(store: Any, ending: str) -> None:
    """However a lease execution ends, its key is let go of, and a retry after it is answered
    from the record (the replay, or `unknown`'s 500), never kept waiting for a holder that is
    gone. A stream settled early lets it go before its first byte."""
    gated = Gated()
    gated.ending = ending
    app = _app(store, "lease", gated, wait_seconds=0.3)
    async with client(app) as http:
        first = asyncio.ensure_future(http.post("/pay", json={"a": 1}, headers=key("k")))
        await asyncio.wait_for(gated.entered.wait(), BOUND)
        mw = idempotency_middleware(app)
        if ending == "stream":
            await until(lambda: not mw.waiters.held)  # settled before its first byte
        else:
            assert len(mw.waiters.held) == 1  # its key, while it runs
        if ending == "cancelled":
            first.cancel()
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), BOUND)
        assert mw.waiters.held == {}
        retry = await asyncio.wait_for(http.post("/pay", json={"a": 1}, headers=key("k")), BOUND)
    assert mw.waiters.held == {}
    assert gated.runs == 1
    if ending in ("error", "cancelled"):
        assert_problem(retry, 409, "outcome-unknown")  # no reconciler to ask
    else:
        assert retry.headers.get("idempotent-replayed") == "true"


@pytest.mark.parametrize("first", MODES)
async def test_a_duplicate_in_another_process_of_the_other_mode_waits_for_the_replay(
    store: Any, first: str
) -> None:
    """A deploy moving a route from one mode to the other: one process runs it in `first`
    mode, another (its own middleware on the same store, its own slots and held keys) in the
    other. A duplicate sent to the second waits for the first's original and is replayed; each
    process's cap counts its own requests only, and neither holds a key after."""
    gated = Gated()
    apps = {m: _app(store, m, gated, wait_seconds=10) for m in MODES}
    second = MODES[1 - MODES.index(first)]
    async with client(apps[first]) as one, client(apps[second]) as other:
        original = asyncio.ensure_future(one.post("/pay", json={"a": 1}, headers=key("k")))
        try:
            await asyncio.wait_for(gated.entered.wait(), BOUND)
            duplicate = asyncio.ensure_future(other.post("/pay", json={"a": 1}, headers=key("k")))
            await wait_for_waiters(apps[second], 1)
        finally:
            gated.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(original, duplicate), BOUND)
    assert [a.status_code for a in answers] == [201, 201], answers[1].text
    assert answers[1].headers.get("idempotent-replayed") == "true"
    assert gated.runs == 1
    for app in apps.values():
        assert idempotency_middleware(app).waiters.held == {}
