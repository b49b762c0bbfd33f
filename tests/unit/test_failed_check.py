"""A startup check that fails at a request (no lifespan startup reached the middleware: httpx's
ASGITransport, a TestClient outside `with`, a server started without one): every request after
it is answered `500 server-misconfigured` as a problem document, under the middleware's problem
base, and the check's error is raised for the server to log and a test client to raise, a new
exception each time (one raised again and again grew its traceback by the request's frames at
every request, and kept them alive)."""

from __future__ import annotations

import asyncio
import logging
import traceback

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.errors import ConfigurationError
from tests.apps import asgi_request
from tests.integration.test_startup_checks import startup as lifespan_startup

BASE = "https://errors.example/idempotency/"
MISTAKE = "policies['POST /nope'] matches no route"


async def pay(request: Request) -> Response:
    return JSONResponse({"ok": True}, status_code=201)


def misconfigured_app() -> Starlette:
    """A policy for a route that does not exist: the check fails, naming it."""
    return Starlette(
        routes=[Route("/pay", pay, methods=["POST", "GET"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                tenant_resolver=lambda scope: "t",
                policies={"POST /nope": Policy()},
                problem_base=BASE,
            )
        ],
    )


def client(app: Starlette, raising: bool) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raising)
    return httpx.AsyncClient(transport=transport, base_url="http://t")


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_every_request_after_a_failed_check_is_a_problem_document(
    method: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        async with client(misconfigured_app(), raising=False) as c:
            for _ in range(3):
                r = await c.request(method, "/pay", headers={"idempotency-key": "k"}, json={})
                assert r.status_code == 500
                assert r.headers["content-type"] == "application/problem+json"
                problem = r.json()
                assert problem["type"] == BASE + "server-misconfigured"
                assert problem["status"] == 500
                assert "the request was not processed" in problem["detail"]
                assert "nope" not in r.text  # the configuration is the server's business
    checks = [r for r in caplog.records if MISTAKE in r.getMessage()]
    assert len(checks) == 1  # the check ran, and was logged, once


async def test_the_checks_error_is_raised_anew_at_each_request() -> None:
    """A client that raises the app's exceptions (Starlette's TestClient does by default) gets
    the check's own error, each time a new exception whose traceback is this request's alone."""
    raised: list[ConfigurationError] = []
    async with client(misconfigured_app(), raising=True) as c:
        for _ in range(4):
            with pytest.raises(ConfigurationError, match=r"policies\['POST /nope'\]") as info:
                await c.post("/pay", headers={"idempotency-key": "k"}, json={})
            raised.append(info.value)
    assert len({id(exc) for exc in raised}) == len(raised)
    depths = [len(traceback.extract_tb(exc.__traceback__)) for exc in raised]
    assert depths == [depths[0]] * len(depths), depths


async def test_a_lifespan_after_a_failed_check_fails_with_the_same_error() -> None:
    """The check runs once: a lifespan startup after a request that failed it fails too."""
    app = misconfigured_app()
    async with client(app, raising=False) as c:
        assert (await c.post("/pay", headers={"idempotency-key": "k"}, json={})).status_code == 500
    sent = await lifespan_startup(app)
    assert sent[0]["type"] == "lifespan.startup.failed", sent
    assert MISTAKE in sent[0]["message"]


async def test_a_cancelled_answer_stays_a_cancellation() -> None:
    """The server cancels the request while its 500 is being sent (its shutdown): the task ends
    cancelled, as every cancelled request does, not with the check's error in place of it."""
    app = misconfigured_app()
    async with client(app, raising=False) as c:  # (the first request runs the check)
        assert (await c.post("/pay", headers={"idempotency-key": "k"}, json={})).status_code == 500
    sending = asyncio.Event()

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sending.set()
        await asyncio.Event().wait()  # a client that never takes the answer

    scope = asgi_request("/pay", "k", 2)
    task = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.wait_for(sending.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failed_answer_raises_the_checks_error_from_it() -> None:
    """A send that fails (the client gone) does not hide the check's error: it is its cause."""
    app = misconfigured_app()
    async with client(app, raising=False) as c:
        assert (await c.post("/pay", headers={"idempotency-key": "k"}, json={})).status_code == 500

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        raise OSError("the client left")

    scope = asgi_request("/pay", "k", 2)
    with pytest.raises(ConfigurationError, match="POST /nope") as info:
        await app(scope, receive, send)
    assert isinstance(info.value.__cause__, OSError)
