"""The middleware behind real ASGI servers on 127.0.0.1, spoken to over raw sockets: what HTTP/1.x
clients do that test transports never do (pipelining, HTTP/1.0, chunked bodies, `Expect:
100-continue`, leaving mid-body) still writes each effect once, counted in the database. And
hypercorn's HTTP/2 extensions (early hints, push promises, trailers), when hypercorn and h2 are
installed: the guarded response reaches the client whole, and a retry gets the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore
from tests.apps import BOUND, build_app, count, records
from tests.apps.servers import connection, read_response, uvicorn_serving

pytestmark = pytest.mark.asyncio

BODY = b'{"amount": 5}'
PATH = "/accounts/a1/credits"


def request(key: str | None, body: bytes = BODY, *, version: bytes = b"1.1") -> bytes:
    lines = [b"POST " + PATH.encode() + b" HTTP/" + version, b"host: test"]
    if key is not None:
        lines.append(b"idempotency-key: " + key.encode())
    lines += [
        b"authorization: Bearer demo-a",
        b"content-type: application/json",
        b"content-length: %d" % len(body),  # (last: the chunked request replaces it)
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_http1_clients_get_each_effect_once(pg_store: Any, pool: Any, http: str) -> None:
    app = build_app(pg_store)
    async with uvicorn_serving(app, http) as port:
        # Pipelined on one connection: a request, its retry, the key with another body, another.
        async with connection(port) as (reader, writer):
            writer.write(
                request("p1") + request("p1") + request("p1", b'{"amount": 6}') + request("p2")
            )
            answers = [await asyncio.wait_for(read_response(reader), BOUND) for _ in range(4)]
        assert [status for status, _, _ in answers] == [201, 201, 422, 201]
        assert answers[1][1][b"idempotent-replayed"] == b"true"
        assert answers[1][2] == answers[0][2]

        # HTTP/1.0, retried over HTTP/1.1.
        async with connection(port) as (reader, writer):
            writer.write(request("old", version=b"1.0"))
            old = await asyncio.wait_for(read_response(reader), BOUND)
        async with connection(port) as (reader, writer):
            writer.write(request("old"))
            retry = await asyncio.wait_for(read_response(reader), BOUND)
        assert (old[0], retry[0], retry[2]) == (201, 201, old[2])
        assert retry[1][b"idempotent-replayed"] == b"true"

        # A chunked body in 1-byte chunks is the same request as the body at once.
        async with connection(port) as (reader, writer):
            head = request("chunked").split(b"content-length")[0]
            chunks = b"".join(b"1\r\n%c\r\n" % byte for byte in BODY)
            writer.write(head + b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
            chunked = await asyncio.wait_for(read_response(reader), BOUND)
            writer.write(request("chunked"))
            retry = await asyncio.wait_for(read_response(reader), BOUND)
        assert (chunked[0], retry[1][b"idempotent-replayed"]) == (201, b"true")

        # Expect: 100-continue: the body follows the server's 100.
        async with connection(port) as (reader, writer):
            with_expect = request("expect").replace(
                b"\r\n\r\n", b"\r\nexpect: 100-continue\r\n\r\n"
            )
            writer.write(with_expect[: -len(BODY)])
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert interim.startswith(b"HTTP/1.1 100")
            writer.write(BODY)
            assert (await asyncio.wait_for(read_response(reader), BOUND))[0] == 201

        # A client that leaves mid-body claims nothing: its retry runs, once.
        async with connection(port) as (reader, writer):
            writer.write(request("left")[:-4])
            await writer.drain()
        assert "left" not in [r["idem_key"] for r in await records(pool)]
        async with connection(port) as (reader, writer):
            writer.write(request("left"))
            assert (await asyncio.wait_for(read_response(reader), BOUND))[0] == 201

    # p1, p2, old, chunked, expect, left: one ledger row each.
    assert await count(pool, "test_ledger") == 6
    assert app.state.probe.calls == 6
    assert sorted(r["idem_key"] for r in await records(pool)) == sorted(
        ["p1", "p2", "old", "chunked", "expect", "left"]
    )


# -- hypercorn's HTTP/2 extensions -------------------------------------------------------------


class _Trailers:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        offered = "http.response.trailers" in scope["extensions"]
        headers = [(b"content-type", b"text/plain"), (b"trailer", b"x-sum")]
        start = {"type": "http.response.start", "status": 201, "headers": headers}
        await send({**start, "trailers": offered})
        await send({"type": "http.response.body", "body": b"hello"})
        if offered:
            await send({"type": "http.response.trailers", "headers": [(b"x-sum", b"42")]})


def _h2_app(runs: list[str]) -> Starlette:
    async def hints(request: Request) -> Response:
        runs.append("hints")
        await request.send_early_hints("</style.css>; rel=preload")
        await request.send_push_promise("/style.css")
        return JSONResponse({"ok": True}, status_code=201)

    class Trailers(_Trailers):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            runs.append("trailers")
            await super().__call__(scope, receive, send)

    return Starlette(
        routes=[
            Route("/hints", hints, methods=["POST"]),
            Route("/trailers", Trailers(), methods=["POST"]),
        ],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t")
        ],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize(
    ("path", "body"),
    [("/hints", b'{"ok":true}'), ("/trailers", b"hello")],
    ids=["hints", "trailers"],
)
async def test_hypercorn_http2_extensions_reach_the_client_and_a_retry_gets_the_record(
    path: str, body: bytes
) -> None:
    hypercorn_asyncio = pytest.importorskip("hypercorn.asyncio")
    hypercorn_config = pytest.importorskip("hypercorn.config")
    pytest.importorskip("h2")
    import httpx

    runs: list[str] = []
    config = hypercorn_config.Config()
    port = _free_port()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    stop = asyncio.Event()
    server = asyncio.ensure_future(
        hypercorn_asyncio.serve(_h2_app(runs), config, shutdown_trigger=stop.wait)
    )
    try:
        async with httpx.AsyncClient(
            http1=False,
            http2=True,
            base_url=f"http://127.0.0.1:{port}",
            headers={"te": "trailers"},
            timeout=BOUND,
        ) as client:
            for _ in range(500):
                with contextlib.suppress(httpx.ConnectError):
                    await client.get("/")
                    break
                await asyncio.sleep(0.01)
            first = await client.post(path, headers={"idempotency-key": "k"}, content=b"{}")
            assert (first.http_version, first.status_code, first.content) == ("HTTP/2", 201, body)
            retry = await client.post(path, headers={"idempotency-key": "k"}, content=b"{}")
            assert (retry.status_code, retry.headers["idempotent-replayed"]) == (201, "true")
    finally:
        stop.set()
        await asyncio.wait_for(server, BOUND)
    assert runs == [path.strip("/")]
