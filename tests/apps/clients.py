"""The test apps' authentication (bearer tokens naming a tenant) and the clients that call them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy

TOKENS = {"demo-a": "tenant-a", "demo-b": "tenant-b"}


class BearerBackend(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        header = conn.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        tenant = TOKENS.get(token) if scheme.lower() == "bearer" else None
        if tenant is None:
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(tenant)


def one_route_app(
    path: str, handler: Callable[[Request], Awaitable[Response]], **middleware_options: Any
) -> Starlette:
    """`POST path` answered by `handler`, behind the bearer authentication and the middleware
    (`middleware_options`: the store, a policy, a tenant resolver...)."""
    return Starlette(
        routes=[Route(path, handler, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, **middleware_options),
        ],
    )


def counting_pay_app(store: Any, mode: str, **policy_options: Any) -> tuple[Starlette, list[int]]:
    """`POST /pay` (its body read; answers 201 with its run's number) under a default policy of
    `policy_options` in `mode` ("transactional", or "lease" with a 30 s lease); the list counts
    its handler's runs."""
    runs: list[int] = []

    async def pay(request: Request) -> Response:
        await request.body()
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=201)

    lease = {"mode": Mode.LEASE, "lease_seconds": 30} if mode == "lease" else {}
    policy = Policy(**policy_options, **lease)
    return one_route_app("/pay", pay, store=store, default_policy=policy), runs


def client(app: Starlette, token: str | None = "demo-a") -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
        headers=headers,
    )


def post_scope(path: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    """A scope for driving an app directly, as an ASGI server would: a POST with `headers`."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8", "surrogatepass"),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }


def asgi_request(
    path: str, idem_key: str, content_length: int, *, token: str = "demo-a", query: bytes = b""
) -> dict[str, Any]:
    """An authenticated (tenant-a, unless `token` says otherwise) JSON POST's scope."""
    headers = [
        (b"host", b"test"),
        (b"authorization", f"Bearer {token}".encode()),
        (b"idempotency-key", idem_key.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(content_length).encode()),
    ]
    return post_scope(path, headers, query)


class AsServer:
    """`receive` and `send` for driving an app directly as uvicorn or hypercorn would: the body
    in one message, then nothing until the response is complete, then `http.disconnect` (what
    those servers answer once it is); or, with `leaves_after`, once that many body messages were
    sent (a client that leaves mid-stream). `sent` holds what the app sent."""

    def __init__(self, body: bytes, leaves_after: int | None = None) -> None:
        self.body = body
        self.leaves_after = leaves_after
        self.delivered = False
        self.complete = asyncio.Event()
        self.gone = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)  # (after the client left too: uvicorn drops them silently)
        if message["type"] != "http.response.body":
            return
        if not message.get("more_body", False):
            self.complete.set()
            self.gone.set()
        bodies = sum(m["type"] == "http.response.body" for m in self.sent)
        if self.leaves_after is not None and bodies >= self.leaves_after:
            self.gone.set()

    def sent_body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
