"""Running an app's ASGI lifespan around an operator's command, as a server runs it around serving.

`idem-middleware reconcile --app` calls the app's reconcilers outside any server. A reconciler
usually asks its downstream system through what the app opens in its lifespan (an HTTP client,
its own database pool, the app's store): without the lifespan, every call failed ("the store is
not open") and each record counted `failed`. The lifespan's startup now runs before the
reconcilers and its shutdown after them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

#: The bound on the app's startup and on its shutdown.
LIFESPAN_SECONDS = 60.0


class LifespanFailed(Exception):
    """The app's lifespan startup failed, or did not finish in time."""


@contextlib.asynccontextmanager
async def running(app: Any, seconds: float = LIFESPAN_SECONDS) -> AsyncIterator[None]:
    """The app's lifespan startup, the block, then its shutdown (each bounded by `seconds`).

    An app that does not take part in the lifespan protocol (it raises on a lifespan scope
    before answering, as uvicorn's `--lifespan auto` tolerates) runs the block without one.
    """
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: dict[str, Any]) -> None:
        await outbox.put(message)

    task = asyncio.ensure_future(_contained(app(scope, receive, send)))
    try:
        await inbox.put({"type": "lifespan.startup"})
        answer = await _answer(task, outbox, seconds, "startup")
        if answer is None:  # no lifespan: nothing to start or stop
            yield
            return
        if answer.get("type") != "lifespan.startup.complete":
            raise LifespanFailed(
                "its lifespan's startup failed (--no-lifespan skips it): "
                + str(answer.get("message", ""))
            )
        try:
            yield
        finally:
            await inbox.put({"type": "lifespan.shutdown"})
            await _answer(task, outbox, seconds, "shutdown")
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _contained(lifespan: Any) -> None:
    """The app's lifespan, whose `sys.exit("...")` (a startup's way to stop on missing
    configuration) or KeyboardInterrupt is an error of its task: asyncio lets those out of the
    event loop, past the command's own message (a traceback, exit status 1). Its framework has
    answered the startup as failed by then (Starlette does), and the command says so."""
    try:
        await lifespan
    except (SystemExit, KeyboardInterrupt) as exc:
        raise LifespanFailed(f"it raised {type(exc).__name__}: {exc}") from exc


async def _answer(
    task: asyncio.Future[Any], outbox: asyncio.Queue[dict[str, Any]], seconds: float, step: str
) -> dict[str, Any] | None:
    """The app's answer to a lifespan step; None if the app returned or raised first."""
    getting = asyncio.ensure_future(outbox.get())
    try:
        done, _ = await asyncio.wait(
            {getting, task}, timeout=seconds, return_when="FIRST_COMPLETED"
        )
    finally:
        if not getting.done():
            getting.cancel()
    if getting in done:
        return getting.result()
    if task in done:  # it returned or raised without answering: it has no lifespan
        return None
    raise LifespanFailed(
        f"its lifespan's {step} did not finish in {seconds:g} s (--no-lifespan skips it)"
    )
