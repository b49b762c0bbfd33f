"""Watching a guarded request's client for leaving, after its body: while a duplicate waits
(it stops waiting, holding nothing) and while a long transactional handler runs (it is cancelled
and rolls back).

The server's receive() is read by one task per request, shared by every watch and left running
until the request ends (`Exchange.run` cancels it): a watch that is cancelled (each round of a
duplicate's wait, a handler that finished) cancels only its own wait. gunicorn's ASGI worker
takes a cancelled receive() for the client gone, and answers every later one `http.disconnect`
at once: with a read per round, a duplicate's second round of waiting saw its client gone and
the duplicate was answered nothing (gunicorn's plain-text 500).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from starlette.types import Receive

from .errors import ClientGone

logger = logging.getLogger("idem_middleware")


class ClientWatch:
    """The watch's part of `Exchange` (which sets these slots, and `receive`: the server's)."""

    #: `client_watch`: the one read of the server's receive() after the body, shared by every
    #: watch. `disconnected`: see `disconnect_event`.
    __slots__ = ("client_watch", "disconnected")

    receive: Receive
    client_watch: asyncio.Future[None] | None
    disconnected: asyncio.Event | None

    async def until_disconnect(self) -> None:
        """Returns once the client has left."""
        if self.client_watch is None:
            self.client_watch = asyncio.ensure_future(self._read_until_disconnect())
        await asyncio.shield(self.client_watch)

    async def _read_until_disconnect(self) -> None:
        """(After the body, the server's receive() yields only the client's disconnect.)"""
        for _ in range(100):
            if (await self.receive())["type"] == "http.disconnect":
                return
        await asyncio.Event().wait()  # a server that keeps talking: never a disconnect

    async def wait_present(self, waiting: Coroutine[Any, Any, object]) -> None:
        """A duplicate's `waiting`, cut short by its client leaving (ClientGone: it holds no
        claim, and its waiting place goes back now, not when its wait would have run out)."""
        inner = asyncio.ensure_future(waiting)
        watch = asyncio.ensure_future(self.until_disconnect())
        try:
            done, _ = await asyncio.wait((inner, watch), return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                if watch.exception() is None:
                    raise ClientGone("the client left while its request waited for another")
                logger.debug(
                    "the client watch of a waiting duplicate failed: %r", watch.exception()
                )
            await inner  # (its own error, if it raised; or the rest of the wait)
        finally:
            inner.cancel()
            watch.cancel()

    def client_left(self) -> bool:
        """Whether the server has reported the client gone (to a watch, or to the app's
        receive() after its body: both read it through `until_disconnect`)."""
        read = self.client_watch
        return read is not None and read.done() and not read.cancelled() and not read.exception()

    def disconnect_event(self) -> asyncio.Event:
        """Set when the watched client left; made when first needed (most requests never are)."""
        if self.disconnected is None:
            self.disconnected = asyncio.Event()
        return self.disconnected
