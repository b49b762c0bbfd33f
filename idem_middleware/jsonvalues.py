"""What JSON cannot carry as given, and PostgreSQL cannot store: looked for in a value before it
is written, so the caller gets a clear error instead of a changed value or a refused statement.

- NaN and the infinities: orjson writes them as null, so `inf` and `-inf` would be one value
  (in a dataclass's attribute or an enum's value too: orjson writes those natively).
- A datetime whose UTC offset has seconds: orjson writes it rounded to the minute.
- NUL in a string or a key: valid JSON (`\\u0000`), but neither `text` nor `jsonb` stores it, and
  the refused statement aborts the caller's transaction.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields, is_dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import orjson

_DEEPEST = 256  # (orjson refuses deeper nesting anyway)
_MINUTE = timedelta(minutes=1)
#: A datetime with a UTC offset as orjson writes one (`...T12:00:00+00:20"`).
_WRITTEN_OFFSET = re.compile(rb'[0-9]:[0-9]{2}(?:\.[0-9]{1,6})?[+-][0-9]{2}:[0-9]{2}"')


def non_finite(value: Any, depth: int = 0) -> bool:
    """Whether a float in `value` (lists, tuples, dicts, dataclasses and enums, as orjson walks
    them) is not finite."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth > _DEEPEST:
        return False
    if isinstance(value, list | tuple):
        return any(non_finite(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return any(non_finite(item, depth + 1) for item in value.values())
    if isinstance(value, Enum):  # (orjson writes a member as its value)
        return non_finite(value.value, depth + 1)
    if is_dataclass(value) and not isinstance(value, type):
        # (orjson writes them without the names that start with "_")
        return any(
            not name.startswith("_") and non_finite(item, depth + 1)
            for name, item in _attributes(value).items()
        )
    return False


def _attributes(value: Any) -> dict[str, Any]:
    """A dataclass instance's attributes as orjson walks them: its `__dict__`, or its fields
    when it has none (`__slots__`)."""
    attributes: dict[str, Any] | None = getattr(value, "__dict__", None)
    if attributes is None:
        attributes = {f.name: getattr(value, f.name, None) for f in fields(value)}
    return attributes


def changed_part(value: Any, *, attributes: bool = True, depth: int = 0) -> tuple[str, str] | None:
    """What orjson writes of `value` other than as given, named, and the fix to suggest; None if
    nothing. Walked as orjson walks values (lists, tuples, dicts, dataclasses and enums):
    - with `attributes`, a dataclass's attribute whose name starts with "_" (left out);
    - a datetime whose UTC offset is not whole minutes (a zone's local mean time before the
      1900s, as `Europe/Amsterdam`'s +00:19:32; a `timezone` of seconds), which orjson writes
      rounded to the minute: another instant's text.
    Written as JSON, two values that differ only there are the same."""
    if depth > _DEEPEST or isinstance(value, str | int | float | type):
        return None
    items: Any = ()
    if isinstance(value, datetime):
        offset = value.utcoffset()
        if offset is not None and offset % _MINUTE:
            return (
                f"a datetime whose UTC offset ({offset}) has seconds, which JSON writes rounded "
                "to the minute",
                "pass it in UTC, or as a string",
            )
        return None
    if isinstance(value, list | tuple):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    elif isinstance(value, Enum):
        items = (value.value,)
    elif is_dataclass(value):
        found = _attributes(value)
        hidden = (
            next((name for name in found if name.startswith("_")), None) if attributes else None
        )
        if hidden is not None:
            return (
                f"{type(value).__name__}.{hidden}, an attribute JSON leaves out",
                "give it a public name, or pass a dict",
            )
        items = found.values()
    for item in items:
        if (changed := changed_part(item, attributes=attributes, depth=depth + 1)) is not None:
            return changed
    return None


def holds_nul(decoded: Any, depth: int = 0) -> bool:
    """Whether a string or a key in `decoded` (a value as orjson.loads returns it) holds NUL."""
    if isinstance(decoded, str):
        return "\x00" in decoded
    if depth > _DEEPEST:
        return False
    if isinstance(decoded, list):
        return any(holds_nul(item, depth + 1) for item in decoded)
    if isinstance(decoded, dict):
        return any("\x00" in k or holds_nul(v, depth + 1) for k, v in decoded.items())
    return False


def json_text(value: Any, what: str) -> bytes:
    """`value` as JSON, refused (ValueError) when it holds NaN, an infinity or a NUL; a value
    JSON cannot hold at all is orjson's TypeError, as it raised it."""
    data = orjson.dumps(value)
    # (Each looked for only where the output shows it may be there.)
    if b"null" in data and non_finite(value):
        raise ValueError(
            f"{what} holds NaN or an infinity, which JSON would carry as null: pass it as a string"
        )
    if b"\\u0000" in data and holds_nul(orjson.loads(data)):
        raise ValueError(f"{what} holds a NUL character, which PostgreSQL cannot store")
    if _WRITTEN_OFFSET.search(data) and (changed := changed_part(value, attributes=False)):
        raise ValueError(f"{what} holds {changed[0]}: {changed[1]}")
    return data
