"""What PostgreSQL text can hold: a name a policy pins, or a job's operation, key and tenant, is
refused where it is given, not by the driver at every request."""

from __future__ import annotations


def storable_text(value: str | None) -> bool:
    """Whether PostgreSQL text can hold `value` (None: nothing to hold): no NUL, and no unpaired
    surrogate (not encodable as UTF-8). The driver refuses either, as an error of its own."""
    if value is None or value.isascii():
        return value is None or "\x00" not in value
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in value
