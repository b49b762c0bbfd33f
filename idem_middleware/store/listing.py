"""What both stores' `list_records` take: the same arguments, checked alike, so that a call that
works on the in-memory twin in a test works on PostgreSQL in production."""

from __future__ import annotations

from collections.abc import Iterable

from .base import State


def checked_listing(
    states: object, tenant: object, operation: object, limit: object
) -> tuple[State, ...]:
    """The states as members (`State.UNKNOWN` or its value, `"unknown"`). A bare str or member
    is refused, as are a limit that is no whole number from 0 to a bigint's most, and a tenant
    or an operation that is no str: the twin took `"unknown"` (matching by substring) where
    PostgreSQL failed on it, and PostgreSQL's driver refused what the twin took."""
    if isinstance(states, str) or not isinstance(states, Iterable):
        raise TypeError(
            f"list_records: states is a list of States ([State.UNKNOWN]), not {states!r:.60}"
        )
    try:
        members = tuple(State(state) for state in states)
    except ValueError:
        names = ", ".join(repr(s.value) for s in State)
        raise ValueError(f"list_records: each of states is one of {names}") from None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < 2**63:
        raise ValueError(f"list_records: limit must be a whole number from 0, not {limit!r:.40}")
    for name, value in (("tenant", tenant), ("operation", operation)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"list_records: {name} is a str or None, not {type(value).__name__}")
    return members
