"""Pinned: a Delayed lets go of the items of an event loop that closed before they fell due
(delayed.Delayed._serving): the first loop's when the next loop served takes its place, another
thread's loop's when a later loop comes. An app served by a loop that closes (a test client's, a
worker's restart) left every request it registered alive, with its exchange and context, for
the life of the process."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

from idem_middleware.delayed import Delayed


class Item:
    def due(self) -> None:  # pragma: no cover - its loop closes before it falls due
        raise AssertionError("fell due")


def _add_on_a_loop_of_its_own(delayed: Delayed) -> weakref.ref[Item]:
    """An item added on a new loop, which then closes before the item falls due."""
    item = Item()

    async def add() -> None:
        delayed.add(item)

    asyncio.run(add())
    return weakref.ref(item)


def _in_a_thread(delayed: Delayed, out: list[weakref.ref[Item]]) -> None:
    thread = threading.Thread(target=lambda: out.append(_add_on_a_loop_of_its_own(delayed)))
    thread.start()
    thread.join(10)


def test_the_first_loops_items_are_let_go_once_another_loop_serves() -> None:
    delayed = Delayed(3600)
    first = _add_on_a_loop_of_its_own(delayed)
    _add_on_a_loop_of_its_own(delayed)  # the next loop: the first is closed
    gc.collect()
    assert first() is None


async def test_another_threads_closed_loops_items_are_let_go_once_a_new_loop_comes() -> None:
    delayed = Delayed(3600)

    async def add_here() -> None:
        delayed.add(Item())  # (this loop, open throughout, is the one served first)

    await add_here()
    other: list[weakref.ref[Item]] = []
    _in_a_thread(delayed, other)  # another loop, closed when its thread ends
    _in_a_thread(delayed, [])  # a later one
    gc.collect()
    assert len(other) == 1
    assert other[0]() is None
