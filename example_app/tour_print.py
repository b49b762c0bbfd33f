"""What the tour prints: its steps, and each request and response in one or two lines."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

#: Headers worth showing on a response; the rest is noise for this tour.
INTERESTING = ("idempotent-replayed", "retry-after", "location")
UUID = re.compile(r'"([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"')


def step(title: str, text: str) -> None:
    print(f"\n=== {title} " + "=" * max(3, 74 - len(title)))
    print(text)


def compact(body: Any, limit: int = 150) -> str:
    # UUIDs shortened to their first 8 digits: enough to tell two responses apart.
    text = UUID.sub(r'"\1…"', json.dumps(body, separators=(", ", ": "), ensure_ascii=False))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def show_request(method: str, path: str, key: str | None, body: Any = None) -> None:
    key_part = f"  Idempotency-Key: {key}" if key else ""
    print(f"  -> {method} {path}{key_part}" + (f"  {compact(body)}" if body is not None else ""))


def show_response(r: httpx.Response) -> None:
    headers = "".join(
        f"  {name.title()}: {r.headers[name]}" for name in INTERESTING if name in r.headers
    )
    try:
        body = compact(r.json())
    except ValueError:
        body = r.text[:150]
    print(f"  <- {r.status_code} {r.reason_phrase}{headers}\n       {body}")
