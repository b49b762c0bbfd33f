"""delayed.py, pinned against hand-made mutants (mutation17):

- an item added after every earlier one fell due (the timer idle) still falls due: a stale
  timer handle left in place, no request's heartbeat started again and no pool checkout's
  deadline ran out;
- an item added later falls due its own delay after it was added, not a whole delay after the
  older item did (a heartbeat started that late has used up two thirds of its lease);
- one timer serves every item (a timer per item is what the module exists to avoid);
- a loop's items stay discardable when a third loop comes to be served.
"""

from __future__ import annotations

import asyncio
import threading

from idem_middleware.delayed import Delayed


class Timed:
    def __init__(self, fired: list[float]) -> None:
        self.fired = fired

    def due(self) -> None:
        self.fired.append(asyncio.get_running_loop().time())


async def _until(check: object, bound: float = 5.0) -> None:
    for _ in range(int(bound / 0.01)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)


async def test_an_item_added_after_the_timer_went_idle_falls_due() -> None:
    delayed = Delayed(0.05)
    first: list[float] = []
    delayed.add(Timed(first))
    await _until(lambda: first)
    assert first
    await asyncio.sleep(0.05)  # the timer idle: nothing registered
    second: list[float] = []
    delayed.add(Timed(second))
    await _until(lambda: second, 2.0)
    assert second, "an item added once the timer went idle never fell due"


async def test_a_later_item_falls_due_its_own_delay_after_it_was_added_not_later() -> None:
    loop = asyncio.get_running_loop()
    delay = 0.4
    delayed = Delayed(delay)
    fired: list[float] = []
    delayed.add(Timed([]))
    await asyncio.sleep(delay * 0.1)
    added = loop.time()
    delayed.add(Timed(fired))
    await _until(lambda: fired)
    assert fired
    # (A whole delay after the first fell due: ~0.36 s late.)
    assert fired[0] - added < delay + 0.15, fired[0] - added


async def test_one_timer_serves_many_items() -> None:
    loop = asyncio.get_running_loop()
    delayed = Delayed(30.0)
    scheduled = len(loop._scheduled)  # type: ignore[attr-defined]
    items = [Timed([]) for _ in range(50)]
    for item in items:
        delayed.add(item)
    assert len(loop._scheduled) - scheduled == 1  # type: ignore[attr-defined]
    for item in items:
        delayed.discard(item)


def test_a_discarded_item_never_falls_due_when_a_third_loop_is_served() -> None:
    delayed = Delayed(0.1)
    fired: list[str] = []
    added, third_served = threading.Event(), threading.Event()

    class Item:
        def due(self) -> None:
            fired.append("second")

    async def first() -> None:
        delayed.add(Timed([]))  # the main loop
        added.set()
        await asyncio.sleep(0.5)

    async def second() -> None:
        item = Item()
        delayed.add(item)  # the second loop's items
        third_served.wait(5)
        delayed.discard(item)  # done sooner
        await asyncio.sleep(0.3)  # (three times the delay)

    async def third() -> None:
        delayed.add(Timed([]))
        third_served.set()

    def run(body: object, wait: threading.Event | None) -> None:
        if wait is not None:
            wait.wait(5)
        asyncio.run(body())  # type: ignore[operator]

    threads = [
        threading.Thread(target=run, args=(first, None)),
        threading.Thread(target=run, args=(second, added)),
    ]
    for t in threads:
        t.start()
    # The third loop comes once the second has added its item.
    added.wait(5)
    asyncio.run(asyncio.sleep(0.02))
    run(third, None)
    for t in threads:
        t.join(10)
    assert fired == [], "a discarded item fell due on the second thread's loop"
