"""Sending the downstream key to third parties: an httpx request hook.

Inside an idempotent operation, every request made with a client that has this hook carries the
operation's stable downstream key as its `Idempotency-Key` (unless it already has one), so a
retry, a takeover or a reconciliation that calls the third party again is deduplicated there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import httpx
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "httpx", exc) from exc

from .context import current_context

__all__ = ["add_downstream_key", "downstream_hooks"]


async def add_downstream_key(request: httpx.Request) -> None:
    context = current_context()
    if context is not None and "idempotency-key" not in request.headers:
        request.headers["Idempotency-Key"] = context.downstream_key


def downstream_hooks() -> dict[str, list[Callable[..., Any]]]:
    """`httpx.AsyncClient(event_hooks=downstream_hooks())`."""
    return {"request": [add_downstream_key]}
