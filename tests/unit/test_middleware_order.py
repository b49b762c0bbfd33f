"""Compression and CORS inside the idempotency middleware make wrong replays: startup says so.

Inside it, GZipMiddleware compresses the response before it is stored, for the first request's
Accept-Encoding, and every retry gets those bytes; CORSMiddleware's headers are missing from the
middleware's own answers and a replay carries the first request's.
"""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore

pytestmark = pytest.mark.asyncio


async def pay(request: Request) -> Response:
    await request.body()
    return JSONResponse({"paid": "x" * 100}, status_code=201)


def _app(names: list[str]) -> Starlette:
    made = {
        "idem": Middleware(
            IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda s: "t"
        ),
        "gzip": Middleware(GZipMiddleware, minimum_size=10),
        "cors": Middleware(CORSMiddleware, allow_origins=["https://a.example"]),
    }
    return Starlette(
        routes=[Route("/pay", pay, methods=["POST"])], middleware=[made[n] for n in names]
    )


async def _warnings(
    app: Starlette, caplog: pytest.LogCaptureFixture
) -> tuple[list[str], httpx.Response]:
    """The warnings of the app's startup (at its first request), and a retry's replay."""
    transport = httpx.ASGITransport(app=app)
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"idempotency-key": "k", "accept-encoding": "gzip"}
            assert (await client.post("/pay", headers=headers, content=b"{}")).status_code == 201
            # A retry that takes no compression.
            headers["accept-encoding"] = "identity"
            retry = await client.post("/pay", headers=headers, content=b"{}")
            assert retry.headers["idempotent-replayed"] == "true"
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING], retry


@pytest.mark.parametrize("inner", ["gzip", "cors"])
async def test_middleware_inside_ours_that_shapes_responses_per_request_is_warned_of(
    inner: str, caplog: pytest.LogCaptureFixture
) -> None:
    warned, _ = await _warnings(_app(["idem", inner]), caplog)
    name = {"gzip": "GZipMiddleware", "cors": "CORSMiddleware"}[inner]
    assert len(warned) == 1
    assert warned[0].startswith(f"idempotency: {name} runs after IdempotencyMiddleware")


async def test_middleware_outside_ours_is_not_warned_of_and_a_replay_is_negotiated_anew(
    caplog: pytest.LogCaptureFixture,
) -> None:
    warned, retry = await _warnings(_app(["gzip", "cors", "idem"]), caplog)
    assert warned == []
    assert "content-encoding" not in retry.headers


async def test_inside_ours_gzip_replays_compressed_bytes_to_a_client_that_took_none() -> None:
    """What the warning is about (the order is the app's to fix, not the middleware's)."""
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=_app(["idem", "gzip"])), base_url="http://t"
    ) as client:
        await client.post("/pay", headers={"idempotency-key": "k"}, content=b"{}")
        headers = {"idempotency-key": "k", "accept-encoding": "identity"}
        retry = await client.post("/pay", headers=headers, content=b"{}")
    assert retry.headers["content-encoding"] == "gzip"
