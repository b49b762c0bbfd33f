"""Sending the downstream key to third parties: an httpx request hook.

Inside an idempotent operation, every request made with a client that has this hook carries the
operation's stable downstream key as its `Idempotency-Key` (unless it already has one), so a
retry, a takeover or a reconciliation that calls the third party again is deduplicated there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

try:
    import httpx
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "httpx", exc) from exc

from .context import current_context

__all__ = ["add_downstream_key", "downstream_hooks"]


class _Done:
    """An awaitable with nothing to wait for (not a coroutine: one a synchronous client never
    awaits is no error)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())  # type: ignore[return-value]


_DONE = _Done()


def add_downstream_key(request: httpx.Request) -> Awaitable[None]:
    """Sets the header at once, and returns an awaitable for `httpx.AsyncClient`, which awaits
    its hooks; `httpx.Client` calls them and awaits nothing (an `async def` hook did nothing
    there, silently: no key was sent)."""
    context = current_context()
    if context is not None and "idempotency-key" not in request.headers:
        request.headers["Idempotency-Key"] = context.downstream_key
    return _DONE


def downstream_hooks() -> dict[str, list[Callable[..., Any]]]:
    """`httpx.AsyncClient(event_hooks=downstream_hooks())`, or `httpx.Client(...)` alike."""
    return {"request": [add_downstream_key]}
