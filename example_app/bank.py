"""A bank simulator with fault controls (docs/example-app.md). Transfers live in memory.

A test double: it keeps no secrets and checks no caller. Run it alone with
`python -m example_app.bank [--host H] [--port P]`; without BANK_URL the example app mounts the
same app in-process under `/bank`, where it answers loopback clients only (every tenant's
transfers and the fault switch are there).

Faults apply to `POST /transfers` only:
- `delay_ms`: wait after recording the transfer, before answering (the caller times out; the
  money has moved);
- `fail_after_record`: record the transfer, then answer this status (the response is lost);
- `fail_status`: answer this status without recording anything.

The bank is also the consumer of the app's outbox events: `POST /webhooks` (JSON `{event_id,
topic, payload}`, `Idempotency-Key` = the event id) counts every delivery and applies each event
id once; `GET /webhooks` shows `{"deliveries": n, "applied": [event ids]}`. The fault
`webhook_delay_ms` applies the event, then waits before answering (until the caller hangs up at
the latest), so a publisher can be killed after sending and before marking the event sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idem_middleware import not_idempotent

from .supervisor import stop_when_orphaned


def _loopback(scope: Scope) -> bool:
    client = scope.get("client")
    try:
        return client is not None and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False  # a unix socket's or a test transport's made-up name


@dataclass
class Faults:
    delay_ms: int = 0
    fail_after_record: int | None = None
    fail_status: int | None = None
    webhook_delay_ms: int = 0


@dataclass
class Bank:
    """The bank's state: transfers by the caller's idempotency key, and the active faults."""

    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    #: Webhook deliveries received, and the event ids applied (each once, in arrival order).
    deliveries: int = 0
    applied: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


#: Final statuses that carry no body: the bank's error body would break the answer.
_BODILESS = frozenset({204, 205, 304})


def _status(value: Any) -> int | None:
    """A fault's status: null, or a final one HTTP can send with the bank's error body (another
    would break the bank's answers: a 1xx is no final answer, a 204 has no body)."""
    if value is None:
        return None
    if type(value) is not int or not 200 <= value <= 599 or value in _BODILESS:
        raise ValueError(f"{value!r} is not an HTTP status the bank can answer with")
    return value


#: The longest delay a fault takes, in milliseconds (about 24.8 days): a longer one (10**400, say)
#: was accepted, and every transfer after it recorded, then answered a 500 (no float holds it).
MAX_DELAY_MS = 2**31 - 1


def _milliseconds(value: Any) -> int:
    """A fault's delay: a JSON integer from 0 to MAX_DELAY_MS (null or absent: 0)."""
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value <= MAX_DELAY_MS:
        raise ValueError(f"{value!r} is not a delay in milliseconds")
    return value


async def _json_object(request: Request) -> dict[str, Any] | None:
    """The body as a JSON object ({} for an empty one); None if it is not one."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"error": detail}, status_code=status)


async def _linger(request: Request, seconds: float) -> None:
    """Wait `seconds`, or until the caller hangs up (nobody would read the answer)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        if await request.is_disconnected():
            return
        await asyncio.sleep(min(left, 0.05))


class LoopbackOnly:
    """Answers 403 to any client that is not on this machine."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _loopback(scope):
            response = JSONResponse(
                {"error": "the bank simulator answers loopback clients only"}, status_code=403
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_bank_app(*, loopback_only: bool = False) -> Starlette:
    """The bank; `loopback_only` for the copy the example app mounts on its public port."""
    bank = Bank()

    async def create_transfer(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        if not key:
            return _error(400, "Idempotency-Key is required")
        body = await _json_object(request)
        account, amount = (body or {}).get("account"), (body or {}).get("amount")
        # (Not int() of anything: 1.9 was a transfer of 1, and `true` one of 1.)
        if type(account) is not str or type(amount) is not int:
            return _error(400, 'expected {"account": str, "amount": int}')
        faults = bank.faults
        if faults.fail_status is not None:
            return _error(faults.fail_status, "injected failure; nothing was recorded")
        async with bank.lock:
            transfer = bank.transfers.get(key)
            replayed = transfer is not None
            if transfer is None:
                transfer = {
                    "transfer_id": f"tr_{uuid.uuid4().hex[:16]}",
                    "account": account,
                    "amount": amount,
                    "idempotency_key": key,
                }
                bank.transfers[key] = transfer
        if (transfer["account"], transfer["amount"]) != (account, amount):
            return _error(422, "this Idempotency-Key was used for another transfer")
        if faults.delay_ms:
            await asyncio.sleep(faults.delay_ms / 1000)
        if faults.fail_after_record is not None:
            return _error(faults.fail_after_record, "injected failure after recording")
        headers = {"idempotent-replayed": "true"} if replayed else {}
        return JSONResponse(transfer, status_code=201, headers=headers)

    async def get_transfer(request: Request) -> Response:
        transfer = bank.transfers.get(request.path_params["key"])
        if transfer is None:
            return _error(404, "no transfer with this idempotency key")
        return JSONResponse(transfer)

    async def list_transfers(request: Request) -> Response:
        return JSONResponse(list(bank.transfers.values()))

    async def receive_webhook(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        try:
            body = await request.json()
            event_id, _, _ = str(body["event_id"]), str(body["topic"]), body["payload"]
        except (ValueError, KeyError, TypeError):
            return _error(400, 'expected {"event_id": str, "topic": str, "payload": ...}')
        if key != event_id:
            return _error(400, "the Idempotency-Key must be the event id")
        async with bank.lock:
            bank.deliveries += 1
            applied = event_id not in bank.seen
            if applied:  # a redelivery changes nothing
                bank.seen.add(event_id)
                bank.applied.append(event_id)
        if bank.faults.webhook_delay_ms:
            await _linger(request, bank.faults.webhook_delay_ms / 1000)
        return JSONResponse({"applied": applied})

    async def list_webhooks(request: Request) -> Response:
        return JSONResponse({"deliveries": bank.deliveries, "applied": bank.applied})

    async def set_faults(request: Request) -> Response:
        body = await _json_object(request)
        try:
            if body is None:
                raise ValueError("not a JSON object")
            bank.faults = Faults(
                delay_ms=_milliseconds(body.get("delay_ms")),
                fail_after_record=_status(body.get("fail_after_record")),
                fail_status=_status(body.get("fail_status")),
                webhook_delay_ms=_milliseconds(body.get("webhook_delay_ms")),
            )
        except ValueError:
            return _error(
                400, "expected {delay_ms, fail_after_record, fail_status, webhook_delay_ms}"
            )
        return JSONResponse(vars(bank.faults))

    # The bank deduplicates by the caller's key itself; the app's middleware must not guard it
    # (its POSTs carry no tenant) when it is mounted.
    app = Starlette(
        routes=[
            Route("/transfers", not_idempotent(create_transfer), methods=["POST"]),
            Route("/transfers", list_transfers, methods=["GET"]),
            Route("/transfers/{key:path}", get_transfer, methods=["GET"]),
            Route("/webhooks", not_idempotent(receive_webhook), methods=["POST"]),
            Route("/webhooks", list_webhooks, methods=["GET"]),
            Route("/_faults", not_idempotent(set_faults), methods=["POST"]),
        ],
        middleware=[Middleware(LoopbackOnly)] if loopback_only else [],
    )
    app.state.bank = bank
    return app


def port_number(text: str) -> int:
    """A TCP port for `--port` (0: any free one). Else a usage error: uvicorn would bind
    99999 as 34463 while announcing 99999, and fail on -5 with a resolver's error."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return port


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m example_app.bank", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8001)
    args = parser.parse_args(argv)
    app = create_bank_app()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        orphaned = asyncio.create_task(stop_when_orphaned())  # started by a supervisor
        try:
            yield
        finally:
            orphaned.cancel()

    app.router.lifespan_context = lifespan
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
