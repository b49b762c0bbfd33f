"""client_watch.py, pinned against hand-made mutants (mutation17):

- every round of a duplicate's wait shares the one read of the server's receive() (a read per
  round: two receive() calls at once, and gunicorn takes the first, cancelled, for the client
  gone), and each round leaves no task of its own running;
- `client_left()` is False while the read is still pending (the client here): asked then, as an
  incomplete response is, it must answer, not raise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from idem_middleware.client_watch import ClientWatch
from tests.apps import BOUND

Receive = Callable[[], Awaitable[dict[str, Any]]]


class _Watched(ClientWatch):
    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.client_watch = None
        self.disconnected = None


async def test_rounds_of_waiting_share_one_read_and_leave_no_task_behind() -> None:
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}  # pragma: no cover

    async def a_round() -> None:
        await asyncio.sleep(0.01)

    watched = _Watched(receive)
    before = asyncio.all_tasks()
    for _ in range(3):
        await asyncio.wait_for(watched.wait_present(a_round()), BOUND)
    for _ in range(5):
        await asyncio.sleep(0)
    assert reads == 1
    left = {t for t in asyncio.all_tasks() - before if not t.done()}
    assert left == {watched.client_watch}, left
    assert not watched.client_left()  # the read pending: the client is still here
    assert watched.client_watch is not None
    watched.client_watch.cancel()


async def test_client_left_is_false_while_the_read_is_pending() -> None:
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}  # pragma: no cover

    watched = _Watched(receive)
    assert not watched.client_left()  # no read yet
    watching = asyncio.ensure_future(watched.until_disconnect())
    await asyncio.sleep(0)
    assert watched.client_watch is not None
    assert not watched.client_watch.done()
    assert not watched.client_left()
    watching.cancel()
    watched.client_watch.cancel()
