"""An ordinary FastAPI app, written the usual way, with the middleware added as the README shows:
what its features do behind it, on PostgreSQL in both modes and on `MemoryStore`, checked
against what docs/fastapi.md, docs/configuration.md ("The app's other middleware") and
docs/decisions.md ("Responses") say. Background tasks, yield dependencies, exception handlers,
validation errors, FileResponse/Redirect/204/304, routers and mounts, websockets beside guarded
routes, and GZip, CORS, TrustedHost and a session middleware on either side of it."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from idem_middleware import MemoryStore, Mode, Policy
from idem_middleware.fastapi import install
from idem_middleware.store.postgres import PostgresStore
from tests.apps import records

MODES = [Mode.TRANSACTIONAL, Mode.LEASE]
ORIGIN = "https://shop.example"
OTHER = "https://other.example"


class CardDeclined(Exception):
    pass


class ItemIn(BaseModel):
    name: str
    price: int


class ItemOut(BaseModel):
    name: str


class Cookies:
    """Stands in for Starlette's SessionMiddleware (itsdangerous is not a test dependency): a
    fresh `Set-Cookie` on every response, as a rotated session or a CSRF token has."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.issued = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.issued += 1
                cookie = f"session=s{self.issued}; HttpOnly".encode()
                message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie)]
            await send(message)

        await self.app(scope, receive, sending)


def build(
    store: Any, mode: Mode, tmp: Path, inner: tuple[Any, ...] = (), outer: tuple[Any, ...] = ()
) -> FastAPI:
    app = FastAPI()
    app.state.events = []
    events: list[str] = app.state.events
    document = tmp / "receipt.txt"
    document.write_text("receipt 1")

    @app.exception_handler(CardDeclined)
    async def declined(request: Request, exc: CardDeclined) -> JSONResponse:
        return JSONResponse({"error": "card_declined"}, status_code=402)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": "invalid"}, status_code=422)

    async def unit_of_work() -> AsyncIterator[str]:
        events.append("dependency")
        yield "uow"
        events.append("teardown")

    @app.post("/orders", status_code=201, response_model=ItemOut)
    async def create_order(
        item: ItemIn, tasks: BackgroundTasks, uow: str = Depends(unit_of_work)
    ) -> Any:
        events.append("handler")
        tasks.add_task(events.append, "task")
        return {"name": item.name, "price": item.price, "internal": "never shown"}

    @app.post("/charges")
    async def charge() -> None:
        events.append("charge")
        raise CardDeclined

    @app.post("/refunds")
    async def refund() -> None:
        events.append("refund")
        raise HTTPException(409, "not refundable yet", headers={"Retry-After": "3"})

    @app.post("/receipts")
    async def receipt() -> FileResponse:
        return FileResponse(document, media_type="text/plain")

    @app.post("/checkout")
    async def checkout() -> RedirectResponse:
        return RedirectResponse("/orders/1", status_code=303)

    @app.post("/ack", status_code=204)
    async def ack() -> None:
        return None

    @app.post("/unchanged")
    async def unchanged() -> Response:
        return Response(status_code=304, headers={"ETag": '"v1"'})

    router = APIRouter(prefix="/v1", dependencies=[Depends(unit_of_work)])

    @router.post("/payouts")
    async def payout() -> dict[str, str]:
        return {"payout": "po_1"}

    app.include_router(router)
    sub = FastAPI()

    @sub.post("/hooks")
    async def hook() -> dict[str, bool]:
        return {"received": True}

    app.mount("/partner", sub)

    @app.websocket("/orders")
    async def feed(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("echo " + await websocket.receive_text())
        await websocket.close()

    for middleware, options in inner:
        app.add_middleware(middleware, **options)
    install(app, store=store, tenant_resolver=lambda scope: "t", default_policy=Policy(mode=mode))
    for middleware, options in outer:
        app.add_middleware(middleware, **options)
    return app


def _client(app: FastAPI, base_url: str = "http://api.example") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url=base_url)


async def _twice(
    c: httpx.AsyncClient, path: str, key: str, **options: Any
) -> tuple[httpx.Response, httpx.Response]:
    headers = {"idempotency-key": key, **options.pop("headers", {})}
    return await c.post(path, headers=headers, **options), await c.post(
        path, headers=headers, **options
    )


@pytest.fixture(params=["memory", "postgres"])
def either(request: pytest.FixtureRequest) -> MemoryStore | PostgresStore:
    if request.param == "memory":
        return MemoryStore()
    store: PostgresStore = request.getfixturevalue("pg_store")
    return store


@pytest.mark.parametrize("mode", MODES)
async def test_an_ordinary_apps_features_run_once_and_replay_whole(either, mode, tmp_path):
    """Background tasks and a yield dependency run with the first request only; the response
    model's filtering, a custom exception handler's 402, FileResponse, a 303, a 204 and a 304,
    a router's and a mounted app's routes are replayed as first sent."""
    app = build(either, mode, tmp_path)
    events: list[str] = app.state.events
    async with _client(app) as c:
        order = await _twice(c, "/orders", "o", json={"name": "book", "price": 5})
        assert events == ["dependency", "handler", "task", "teardown"]
        declined = await _twice(c, "/charges", "c")
        assert events.count("charge") == 1
        rest = [
            await _twice(c, path, path)
            for path in (
                "/receipts",
                "/checkout",
                "/ack",
                "/unchanged",
                "/v1/payouts",
                "/partner/hooks",
            )
        ]
    assert events.count("task") == 1
    for first, replay in [order, declined, *rest]:
        assert "idempotent-replayed" not in first.headers
        assert replay.headers["idempotent-replayed"] == "true"
        assert (replay.status_code, replay.content) == (first.status_code, first.content)
        assert "content-length" not in replay.headers or replay.headers["content-length"] == str(
            len(first.content)
        )
    assert order[1].json() == {"name": "book"}
    assert declined[1].json() == {"error": "card_declined"}
    receipt, checkout, ack, unchanged, payout, hook = rest
    assert receipt[1].text == "receipt 1"
    assert receipt[1].headers["etag"] == receipt[0].headers["etag"]
    assert checkout[1].headers["location"] == "/orders/1"
    assert (ack[1].status_code, ack[1].content, "content-length" in ack[1].headers) == (
        204,
        b"",
        False,
    )
    assert (unchanged[1].status_code, unchanged[1].headers["etag"]) == (304, '"v1"')
    assert payout[1].json() == {"payout": "po_1"}
    assert hook[1].json() == {"received": True}


@pytest.mark.parametrize("mode", MODES)
async def test_validation_errors_and_4xx_that_mean_retry_are_released(either, mode, tmp_path):
    """The app's own 422 handler and an `HTTPException(409)` with headers release the key:
    each retry runs again and gets the app's answer, never a replay; the corrected request
    with the same key then runs once."""
    app = build(either, mode, tmp_path)
    async with _client(app) as c:
        invalid = await _twice(c, "/orders", "o", json={"name": "book"})
        fixed = await c.post(
            "/orders", headers={"idempotency-key": "o"}, json={"name": "book", "price": 1}
        )
        refused = await _twice(c, "/refunds", "r")
    for first, second in (invalid, refused):
        assert "idempotent-replayed" not in second.headers
        assert (first.status_code, first.content) == (second.status_code, second.content)
    assert invalid[0].json() == {"error": "invalid"}
    assert (fixed.status_code, "idempotent-replayed" in fixed.headers) == (201, False)
    assert refused[1].headers["retry-after"] == "3"
    assert app.state.events.count("refund") == 2


@pytest.mark.parametrize("mode", MODES)
async def test_background_tasks_run_before_the_outcome_is_recorded(pg_store, pool, mode, tmp_path):
    """docs/sqlalchemy.md: a task runs inside the claim. Seen from another connection while it
    runs, transactional mode has recorded nothing (the claim is uncommitted) and lease mode's
    record is still `pending`; once the response is back, `succeeded`."""
    seen: list[list[str]] = []
    app = FastAPI()

    @app.post("/orders", status_code=201)
    async def create_order(tasks: BackgroundTasks) -> dict[str, int]:
        async def look() -> None:
            rows = await pool.fetch("SELECT state FROM idem_requests WHERE idem_key = 'k'")
            seen.append([row["state"] for row in rows])

        tasks.add_task(look)
        return {"order_id": 1}

    install(
        app, store=pg_store, tenant_resolver=lambda scope: "t", default_policy=Policy(mode=mode)
    )
    async with _client(app) as c:
        first, replay = await _twice(c, "/orders", "k")
    assert seen == [[] if mode is Mode.TRANSACTIONAL else ["pending"]]
    assert (first.status_code, replay.headers["idempotent-replayed"]) == (201, "true")
    assert [r["state"] for r in await records(pool)] == ["succeeded"]


async def test_a_websocket_beside_a_guarded_route_passes_through(either, tmp_path):
    """A websocket on a guarded POST route's path is no request to claim: no key needed,
    nothing recorded."""
    app = build(either, Mode.TRANSACTIONAL, tmp_path)
    sent: list[Message] = []
    inbox: list[Message] = [
        {"type": "websocket.connect"},
        {"type": "websocket.receive", "text": "hi"},
    ]

    async def receive() -> Message:
        if inbox:
            return inbox.pop(0)
        await anyio.sleep(1)
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
        "path": "/orders", "raw_path": b"/orders", "root_path": "", "query_string": b"",
        "headers": [(b"host", b"api.example")], "server": ("api.example", 80),
        "client": ("127.0.0.1", 5000), "subprotocols": [], "state": {},
    }  # fmt: skip
    with anyio.fail_after(10):
        await app(scope, receive, send)
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
    assert sent[1]["text"] == "echo hi"


@pytest.mark.parametrize("mode", MODES)
async def test_gzip_inside_stores_the_first_clients_coding_and_outside_codes_each_replay(
    either, mode, tmp_path
):
    """configuration.md: inside, the stored bytes are the compressed ones, replayed with
    `Content-Encoding: gzip` and `Vary` byte for byte, whatever the retry accepts; outside, each
    replay is coded for the client that asks."""
    gz = (GZipMiddleware, {"minimum_size": 10})
    body = {"name": "b" * 200, "price": 1}
    raws = []
    for inner, outer in (((gz,), ()), ((), (gz,))):
        app = build(either, mode, tmp_path, inner=inner, outer=outer)
        async with _client(app) as c:
            pair = []
            for accept in ("gzip", "identity"):
                headers = {"idempotency-key": f"g-{bool(inner)}", "accept-encoding": accept}
                async with c.stream("POST", "/orders", headers=headers, json=body) as r:
                    pair.append((r.headers, b"".join([chunk async for chunk in r.aiter_raw()])))
            raws.append(pair)
    (first_in, retry_in), (first_out, retry_out) = raws
    assert retry_in[1] == first_in[1]
    assert gzip.decompress(retry_in[1]) == b'{"name":"' + b"b" * 200 + b'"}'
    for name in ("content-encoding", "vary"):
        assert retry_in[0][name] == first_in[0][name]
    assert first_out[0]["content-encoding"] == "gzip"
    assert "content-encoding" not in retry_out[0]
    assert retry_out[0]["idempotent-replayed"] == "true"
    assert retry_out[1] == gzip.decompress(first_out[1])


@pytest.mark.parametrize("mode", MODES)
async def test_cors_outside_answers_preflight_and_each_origin_inside_replays_the_first(
    either, mode, tmp_path
):
    """Outside: the preflight is answered without a claim, and a replay carries the CORS
    headers of its own request. Inside: the replay carries those made for the first
    request's Origin; the middleware's own refusals carry none."""
    cors = (
        CORSMiddleware,
        {
            "allow_origins": [ORIGIN, OTHER],
            "allow_headers": ["idempotency-key", "content-type"],
            "allow_methods": ["POST"],
        },
    )
    body = {"name": "book", "price": 1}
    outside = build(either, mode, tmp_path, outer=(cors,))
    async with _client(outside) as c:
        preflight = await c.options(
            "/orders",
            headers={
                "origin": ORIGIN,
                "access-control-request-method": "POST",
                "access-control-request-headers": "idempotency-key",
            },
        )
        await c.post("/orders", headers={"idempotency-key": "k", "origin": ORIGIN}, json=body)
        replay = await c.post(
            "/orders", headers={"idempotency-key": "k", "origin": OTHER}, json=body
        )
        unkeyed = await c.post("/orders", headers={"origin": ORIGIN}, json=body)
    assert preflight.status_code == 200
    assert "idempotency-key" in preflight.headers["access-control-allow-headers"].lower()
    assert replay.headers["access-control-allow-origin"] == OTHER
    assert (unkeyed.status_code, unkeyed.headers["access-control-allow-origin"]) == (400, ORIGIN)
    inside = build(either, mode, tmp_path, inner=(cors,))
    async with _client(inside) as c:
        await c.post(
            "/orders", headers={"idempotency-key": "k-inside", "origin": ORIGIN}, json=body
        )
        replay = await c.post(
            "/orders", headers={"idempotency-key": "k-inside", "origin": OTHER}, json=body
        )
        unkeyed = await c.post("/orders", headers={"origin": ORIGIN}, json=body)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["access-control-allow-origin"] == ORIGIN
    assert (unkeyed.status_code, "access-control-allow-origin" in unkeyed.headers) == (400, False)


@pytest.mark.parametrize("mode", MODES)
async def test_trusted_host_inside_releases_its_400(either, mode, tmp_path):
    """Inside, a host it does not trust is its 400: the key is released, and the same key from
    a trusted host runs the handler."""
    hosts = (TrustedHostMiddleware, {"allowed_hosts": ["api.example"]})
    app = build(either, mode, tmp_path, inner=(hosts,))
    body = {"name": "book", "price": 1}
    async with _client(app, "http://evil.example") as bad, _client(app) as good:
        refused = await bad.post("/orders", headers={"idempotency-key": "k"}, json=body)
        served = await good.post("/orders", headers={"idempotency-key": "k"}, json=body)
    assert refused.status_code == 400
    assert (served.status_code, "idempotent-replayed" in served.headers) == (201, False)
    assert app.state.events.count("handler") == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", ["inner", "outer"])
async def test_a_replay_never_sets_the_first_clients_cookie(either, mode, side, tmp_path):
    """decisions.md: a replay has no stored `Set-Cookie`, on either side; outside, the session
    middleware sets the retry's own."""
    app = build(either, mode, tmp_path, **{side: ((Cookies, {}),)})
    body = {"name": "book", "price": 1}
    async with _client(app) as c:
        first, replay = await _twice(c, "/orders", "k", json=body)
    assert first.headers["set-cookie"] == "session=s1; HttpOnly"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers.get_list("set-cookie") == (
        [] if side == "inner" else ["session=s2; HttpOnly"]
    )
    if isinstance(either, PostgresStore):
        stored = (await records(either.pool))[0]["response_headers"]
        assert b"set-cookie" not in stored
        assert b"session=" not in stored
