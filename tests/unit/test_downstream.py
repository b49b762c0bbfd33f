"""downstream.py and context.current_context: the downstream key goes with calls made inside the
operation, from asynchronous and synchronous httpx clients, and with nothing after it ended."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy, get_context
from idem_middleware.context import current_context
from idem_middleware.downstream import downstream_hooks
from idem_middleware.jobs import idempotent_job


class _Auth(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        return AuthCredentials(["authenticated"]), SimpleUser("tenant-a")


def _bank() -> tuple[list[str | None], httpx.MockTransport]:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("idempotency-key"))
        return httpx.Response(200)

    return seen, httpx.MockTransport(answer)


def _app(endpoint: Callable[..., Any], mode: Mode) -> Starlette:
    return Starlette(
        routes=[Route("/pay", endpoint, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=_Auth()),
            Middleware(
                IdempotencyMiddleware, store=MemoryStore(), default_policy=Policy(mode=mode)
            ),
        ],
    )


async def _post_three(app: Starlette) -> list[str]:
    downstream = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for n in range(3):
            response = await client.post(
                "/pay", json={"n": n}, headers={"idempotency-key": f"k{n}"}
            )
            assert response.status_code == 201, response.text
            downstream.append(response.text)
    return downstream


@pytest.mark.parametrize("mode", list(Mode))
async def test_a_task_a_request_started_sends_no_key_once_that_request_ended(mode: Mode) -> None:
    # A worker started lazily by the first request copies its context variables, and lives on:
    # its calls for later, unrelated work must not carry the first request's downstream key
    # (the third party would take them all for that one call).
    seen, transport = _bank()
    queue: asyncio.Queue[int] = asyncio.Queue()
    workers: list[asyncio.Task[None]] = []

    async with httpx.AsyncClient(transport=transport, event_hooks=downstream_hooks()) as bank:

        async def worker() -> None:
            for _ in range(3):
                await queue.get()
                await bank.post("http://bank/notify")
                queue.task_done()

        async def pay(request: Request) -> Response:
            if not workers:
                workers.append(asyncio.create_task(worker()))
            await bank.post("http://bank/pay")  # inside the operation: its key
            await queue.put(1)
            return PlainTextResponse(get_context(request).downstream_key, 201)

        keys = await _post_three(_app(pay, mode))
        await asyncio.wait_for(queue.join(), 10)
        await workers[0]
    paid = [seen[i] for i in range(len(seen)) if seen[i] is not None]
    assert paid == keys  # each request's own call carried its own key
    assert len(set(keys)) == 3
    assert seen.count(None) == 3  # the worker's calls: no key at all
    assert current_context() is None


async def test_a_synchronous_client_sends_the_key_too() -> None:
    # Starlette runs a plain function in a thread with the request's context: httpx.Client calls
    # the hook and awaits nothing (an `async def` hook sent no key there, silently).
    seen, transport = _bank()
    bank = httpx.Client(transport=transport, event_hooks=downstream_hooks())  # (holds nothing)

    def pay(request: Request) -> Response:
        bank.post("http://bank/pay")
        return PlainTextResponse(get_context(request).downstream_key, 201)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ("coroutine ... was never awaited")
        keys = await _post_three(_app(pay, Mode.TRANSACTIONAL))
    assert seen == keys


async def test_a_task_a_job_started_sends_no_key_once_the_job_ended() -> None:
    seen, transport = _bank()
    started: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(transport=transport, event_hooks=downstream_hooks()) as bank:
        gate = asyncio.Event()

        async def later() -> None:
            await gate.wait()
            await bank.post("http://bank/later")

        @idempotent_job(MemoryStore(), operation="jobs.send", key="key")
        async def send(job: Any, key: str) -> str:
            started.append(asyncio.create_task(later()))
            await bank.post("http://bank/send")
            return str(job.downstream_key)

        downstream = await send(key="k1")
        gate.set()
        await started[0]
    assert seen == [downstream, None]
