"""The floor: the least per-request work a pure-Python idempotency middleware can do.

`FloorMiddleware` is not a product and guards nothing well: it is the yardstick the `floor-memory`
variant measures the real middleware against. It does only what any middleware giving the
guarantee must do on a fresh POST, in one frame: read the key, find the caller (the
authentication middleware's user), buffer the body, fingerprint it (orjson's canonical JSON and
SHA-256), claim the key in a dict, run the handler with its `receive` and `send` replaced, hold
the response, record it, then send it; a key seen before is replayed (or refused for another
body), keeping its records as MemoryStore does (out of the garbage collector's sight). It has no
policies, routes, caps, streaming, client watch, context, observer, problem documents, tenant
resolver or store interface, and it never fails safe (a handler that raises leaves the key
claimed).
"""

from __future__ import annotations

import hashlib
from itertools import chain
from typing import Any

import orjson

_REPLAYED = (b"idempotent-replayed", b"true")


class FloorMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.records: dict[tuple[str, str, bytes], Any] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        key = dict(scope["headers"]).get(b"idempotency-key")
        user = scope.get("user")
        if key is None or user is None or not user.is_authenticated:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
        fingerprint = hashlib.sha256(scope["path"].encode() + b"\0" + canonical).digest()
        record_key = (user.identity, scope["path"], key)
        record = self.records.get(record_key)
        if record is not None:
            if record is ... or record[0] != fingerprint:
                await send({"type": "http.response.start", "status": 409, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            _, status, flat, held = record
            headers = [*zip(flat[::2], flat[1::2], strict=True), _REPLAYED]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": held})
            return
        self.records[record_key] = ...  # claimed
        delivered = False
        response: list[Any] = []

        async def app_receive() -> Any:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def capture(message: Any) -> None:
            response.append(message)

        await self.app(scope, app_receive, capture)
        start = response[0]
        held = b"".join(m.get("body", b"") for m in response[1:])
        # One flat tuple of bytes and numbers, which the collector stops tracking, as
        # MemoryStore keeps its records: a store's records are not per-request work.
        flat = tuple(chain.from_iterable(start.get("headers", ())))
        self.records[record_key] = (fingerprint, start["status"], flat, held)
        await send(start)
        await send({"type": "http.response.body", "body": held})
