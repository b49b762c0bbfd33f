"""Pinned: `Delayed.add` returns when the item falls due, on the loop's clock: `delay` after it
was added (lease_executor reads the lease's end from it: a renewal task that fails to reach the
store gives the lease up when it ends, not a third of a lease before, when it still held it)."""

from __future__ import annotations

import asyncio

from idem_middleware.delayed import Delayed


class Item:
    def due(self) -> None:  # pragma: no cover - discarded before
        raise AssertionError("fell due")


async def test_add_returns_when_the_item_falls_due() -> None:
    delayed = Delayed(60)
    loop = asyncio.get_running_loop()
    item = Item()
    before = loop.time()
    at = delayed.add(item)
    after = loop.time()
    delayed.discard(item)
    assert before + 60 <= at <= after + 60
