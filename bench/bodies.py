"""What a request's body costs the middleware, in place: bodies as payment APIs get them.

`python -m bench.bodies [--requests 3000] [--warmup 300]`: the direct-ASGI loop of `bench.asgi`
(its app: FastAPI, a pydantic body, bearer authentication), request by request
(`bench/paired.py`), bare and behind the middleware with a `MemoryStore` taking turns, fresh keys,
for each body below. The pydantic model reads `amount` and ignores the rest, so the bare app's
work grows little with the body; the middleware digests all of it (its fingerprint). Timed in
place, between FastAPI's own work, the fingerprint's C code (orjson, the byte scans, SHA-256) runs
cache-cold, and costs several times what a loop of its own (`bench.fingerprint`) says.

The bodies: the benchmark's own (`{"amount": 5}`); a 470-byte payment (a customer with an
address, metadata, tags) in ASCII; the same with German names sent as UTF-8; the same with those
characters escaped (`\\u00fc`), as Python's `json.dumps` writes them by default (requests, and
httpx before 0.28, send that); and the ASCII one with decimal amounts (`12.50`) beside `amount`.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Any

from starlette.types import Receive, Scope

from idem_middleware import MemoryStore

from .asgi import build_app, make_requests, receive_once
from .paired import loop_runner, measure_paired

_PAYMENT: dict[str, Any] = {
    "amount": 5,
    "currency": "EUR",
    "description": "Rechnung Nr. 2024-117 für Müller GmbH",
    "customer": {
        "id": "cus_9s8d7f6",
        "email": "kunde@example.com",
        "name": "Jürgen Müller",
        "address": {
            "line1": "Hauptstraße 5",
            "city": "München",
            "postal_code": "80331",
            "country": "DE",
        },
    },
    "metadata": {"order_id": "ord_1234567890", "channel": "web", "items": "3"},
    "statement_descriptor": "SHOP*MUELLER",
    "capture": True,
    "tags": ["priority", "b2b", "eu"],
}
_ASCII = {"ü": "ue", "ß": "ss"}


def _ascii(text: str) -> str:
    for letter, spelled in _ASCII.items():
        text = text.replace(letter, spelled)
    return text


def _bodies() -> dict[str, bytes]:
    utf8 = json.dumps(_PAYMENT, ensure_ascii=False)
    prices = '"amount": 5, "price": 12.50, "fee": 0.30, "tax": 2.38'
    decimals = _ascii(utf8).replace('"amount": 5', prices)
    return {
        "the benchmark's, 13 B": b'{"amount": 5}',
        "a payment, ASCII": _ascii(utf8).encode(),
        "a payment, non-ASCII as UTF-8": utf8.encode(),
        "a payment, non-ASCII escaped": json.dumps(_PAYMENT).encode(),
        "a payment, ASCII, decimal amounts": decimals.encode(),
    }


BODIES = _bodies()


def with_body(body: bytes, tag: str, prefix: str, n: int) -> list[tuple[Scope, Receive]]:
    """`bench.asgi`'s requests, each with `body` (and its Content-Length), their keys starting
    with `tag` and `prefix` (a key is never sent again with another body)."""
    out = []
    for scope, _ in make_requests(f"{tag}-{prefix}", n):
        scope["headers"] = [
            (name, str(len(body)).encode() if name == b"content-length" else value)
            for name, value in scope["headers"]
        ]
        out.append((scope, receive_once(body)))
    return out


async def measure(requests: int, warmup: int) -> list[dict[str, Any]]:
    statuses: dict[int, int] = {}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses[message["status"]] = statuses.get(message["status"], 0) + 1

    apps = {"bare": build_app("bare"), "ours-memory": build_app("ours-memory", MemoryStore())}
    rows = []
    for number, (name, body) in enumerate(BODIES.items()):
        maker = functools.partial(with_body, body, f"b{number}")
        for app in apps.values():
            for scope, receive in maker("warm", warmup):
                await app(scope, receive, send)
        times = await measure_paired(apps, requests, send, maker)  # type: ignore[arg-type]
        bare, ours = (statistics.median(times[app]) for app in apps)
        rows.append({"body": name, "bytes": len(body), "bare": bare, "ours": ours})
    if set(statuses) != {201}:
        raise SystemExit(f"not every request was answered 201: {statuses}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| body | bytes | bare µs | + the middleware, µs (median) | x bare |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        added = row["ours"] - row["bare"]
        lines.append(
            f"| {row['body']} | {row['bytes']} | {row['bare']:,.1f} | {added:+,.1f} "
            f"| {added / row['bare']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bodies", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per app and body")
    p.add_argument("--warmup", type=int, default=300, help="unmeasured requests per app and body")
    args = p.parse_args(argv)
    runner = loop_runner()
    print(markdown(runner(measure(args.requests, args.warmup))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
