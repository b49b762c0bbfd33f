"""Delayed (delayed.py) never calls an item back before its own delay has passed: the timer
armed for an older item calls back only the items due by then (`if at > now: break` in
`_Serving.fire`). Called early, a later request's heartbeat started early, and a pool
checkout's deadline (store/postgres/store.py's `Delayed(acquire_timeout)`) cut a wait short."""

from __future__ import annotations

import asyncio

from idem_middleware.delayed import Delayed


class Timed:
    def __init__(self, name: str, fired: dict[str, float]) -> None:
        self.name = name
        self.fired = fired

    def due(self) -> None:
        self.fired[self.name] = asyncio.get_running_loop().time()


async def test_an_item_added_later_falls_due_its_own_delay_after_it_was_added() -> None:
    loop = asyncio.get_running_loop()
    fired: dict[str, float] = {}
    delay = 0.3
    delayed = Delayed(delay)
    added = {"a": 0.0, "b": 0.0}
    added["a"] = loop.time()
    delayed.add(Timed("a", fired))
    await asyncio.sleep(delay / 2)
    added["b"] = loop.time()
    delayed.add(Timed("b", fired))
    for _ in range(500):  # (bounded: 5 s)
        if len(fired) == 2:
            break
        await asyncio.sleep(0.01)
    assert set(fired) == {"a", "b"}
    for name in ("a", "b"):
        # (Never early; a loaded loop may call back late.)
        assert fired[name] - added[name] >= delay - 0.005, (name, fired[name] - added[name])
    assert fired["b"] > fired["a"]


def test_an_item_discarded_on_another_threads_loop_never_falls_due() -> None:
    """`Delayed.discard` pops the item from every loop's items, not only the first loop's.
    Left in a second thread's (an app of its own, on its own loop, while the first still
    runs), a pool checkout that had its connection (store/postgres/runner.py `checkout`) was
    called back anyway: its request's task cancelled at some later await."""
    import threading

    delayed = Delayed(0.05)
    first_running = threading.Event()
    second_done = threading.Event()
    fired: list[str] = []

    async def first() -> None:
        delayed.add(Timed("first", {}))  # this loop is the main one
        first_running.set()
        for _ in range(500):  # bounded: 5 s
            if second_done.is_set():
                return
            await asyncio.sleep(0.01)

    class Checkout:
        def due(self) -> None:
            fired.append("second")

    async def second() -> None:
        item = Checkout()
        delayed.add(item)
        delayed.discard(item)  # done sooner: its connection came at once
        await asyncio.sleep(0.2)  # (four times the delay: it would have fallen due by now)

    def run_second() -> None:
        first_running.wait(5)
        try:
            asyncio.run(second())
        finally:
            second_done.set()

    threads = [
        threading.Thread(target=lambda: asyncio.run(first())),
        threading.Thread(target=run_second),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert second_done.is_set()
    assert fired == [], "a discarded item fell due on the second thread's loop"
