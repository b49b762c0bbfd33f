"""`list_records` takes the same arguments on both stores, checked alike."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.store.base import State, Store


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"states": "unknown"}, TypeError, "states is a list of States"),
        ({"states": State.UNKNOWN}, TypeError, "states is a list of States"),
        ({"states": ["nonsense"]}, ValueError, "each of states is one of"),
        ({"states": [State.UNKNOWN], "limit": 2**63}, ValueError, "limit must be"),
        ({"states": [State.UNKNOWN], "limit": -1}, ValueError, "limit must be"),
        ({"states": [State.UNKNOWN], "tenant": 5}, TypeError, "tenant is a str or None"),
    ],
)
async def test_list_records_takes_the_same_arguments_on_both_stores(
    store: Store, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Found by probing: the in-memory twin took `"unknown"` (matching states by substring) and
    `State.UNKNOWN` where PostgreSQL failed on both with an AttributeError, so a test passed on
    the twin that crashed in production; a limit past a bigint and a tenant that is no str were
    the driver's own errors. Both refuse them alike now, and both take states by their value."""
    with pytest.raises(error, match=message):
        await store.list_records(**arguments)
    assert await store.list_records(states=["unknown", State.PENDING]) == []
