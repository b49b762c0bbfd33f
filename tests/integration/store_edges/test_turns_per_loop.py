"""A store whose opens took turns in one event loop (two opens at once: the second waited for
the first) opens again, with opens at once, in another loop after its close (two TestClient
blocks on one app, two test modules' fixtures): the lock its opens and closes take turns on is
one per loop (lifecycle.py `Turns`), where one lock waited on in the first loop is bound to it
and refuses every other ("is bound to a different event loop": the open, the app's startup,
fails)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from idem_middleware import PostgresStore


def _in_a_loop_of_its_own(store: PostgresStore) -> list[Any]:
    async def opens_at_once() -> None:
        async with asyncio.timeout(20):
            await asyncio.gather(store.open(), store.open())  # (the second waits its turn)
            assert store.is_open
            await asyncio.gather(store.close(), store.close())
            assert not store.is_open

    results: list[Any] = []

    def target() -> None:
        try:
            results.append(asyncio.run(opens_at_once()))
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(40)
    assert not thread.is_alive()
    return results


def test_opens_taking_turns_in_two_loops_one_after_the_other(db_dsn: str) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    first = _in_a_loop_of_its_own(store)
    second = _in_a_loop_of_its_own(store)
    assert first == [None], first
    assert second == [None], second
