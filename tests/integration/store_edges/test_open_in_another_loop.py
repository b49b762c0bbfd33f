"""`store.open()` awaited in another event loop than the one its pool belongs to (a second test
fixture's, an `asyncio.run` of a script's, outside any app's lifespan, which checks the loop
itself) is refused with a ConfigurationError saying why, instead of being counted as a nested
open: counted, its pool's connections were used from the wrong loop later, and the first
loop's close only took the count down, leaving the store and its pool open (lifecycle.py
`refuse_other_loop`, called by store.py `open`)."""

from __future__ import annotations

import asyncio

import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ConfigurationError
from tests.integration.test_store_lifecycle import BOUND, in_another_loop


def test_an_open_in_another_loop_is_refused_and_the_first_close_closes(db_dsn: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        store = loop.run_until_complete(PostgresStore(dsn=db_dsn, min_size=1, max_size=2).open())
        with pytest.raises(ConfigurationError, match="belongs to another event loop"):
            in_another_loop(store.open())
        loop.run_until_complete(asyncio.wait_for(store.close(), BOUND))
        assert not store.is_open
    finally:
        loop.close()
