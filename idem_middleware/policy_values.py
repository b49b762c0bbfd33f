"""The values a `Policy` takes, checked: flags, enum members, counts, durations and collections
of names (policy.py holds the policy; its `__post_init__` calls these)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable, Collection, KeysView, Set
from datetime import timedelta
from enum import StrEnum
from typing import Any, TypeVar

from starlette.types import Scope

from .errors import ConfigurationError
from .fingerprint import is_json_pointer
from .store.base import StoredResponse

#: `Policy.replay_hook`: `(stored response, scope) -> response to send, or None for unchanged`,
#: sync or async. See `responses.hooked_response`. (Here, not there, so that the policy's hints
#: resolve at run time without an import cycle.)
ReplayHook = Callable[
    [StoredResponse, Scope], StoredResponse | Awaitable[StoredResponse | None] | None
]


def names(value: Any, option: str) -> tuple[str, ...]:
    """A configured collection of strings as a tuple; a lone string is a mistake, not a
    collection of its characters (`include_headers="x-api-version"` means one header)."""
    if isinstance(value, str | bytes):
        raise ConfigurationError(
            f"{option} must be a collection of strings, not the string {value!r}: "
            f"write {option}=({value!r},)"
        )
    if not isinstance(value, Collection):
        raise ConfigurationError(f"{option} must be a collection of strings, not {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise ConfigurationError(f"{option} must hold strings; {item!r} is not one")
    items = tuple(str.__str__(item) for item in value)  # (its text: an enum's `Kind.A` is not)
    # A set's sorted (its order differs by process: another fingerprint in each, a retry a 422).
    if isinstance(value, Set) and not isinstance(value, KeysView):  # (a dict's: ordered)
        return tuple(sorted(items, key=lambda name: (name.lower(), name)))
    return items


def fields(value: Any, option: str) -> tuple[str, ...]:
    """`include_fields` or `exclude_fields`: names, or JSON Pointers that must be well formed."""
    items = names(value, option)
    for item in items:
        if item.startswith("/") and not is_json_pointer(item):
            raise ConfigurationError(
                f"{option}: {item!r} is not a JSON Pointer (~ must be ~0 or ~1): write ~0 for "
                f"a ~ and ~1 for a / inside a member's name"
            )
    return items


#: The longest duration a policy takes, in seconds: 100 years (365-day years). Far past any
#: sensible setting, and well inside what PostgreSQL's interval and timestamp arithmetic holds
#: (`now() + retention`; its timestamps end in the year 294276).
MAX_SECONDS = 100 * 365 * 24 * 3600

#: The shortest lease a policy takes: its heartbeat renews it every third of it, so a lease of
#: microseconds lapsed at once (PostgreSQL's timestamps end there) and renewed without a pause.
MIN_LEASE_SECONDS = 0.1

FLAGS = ("guard", "key_required", "allow_anonymous", "accept_while_in_flight", "require_token")
#: The integer options: name, least value, greatest value (None: no bound).
COUNTS: tuple[tuple[str, int, int | None], ...] = (
    ("max_body_bytes", 0, None),
    ("max_response_bytes", 0, None),
    ("max_fields", 1, None),
    ("max_json_values", 1, None),
    ("retry_after_seconds", 0, MAX_SECONDS),
    ("max_serialization_retries", 0, 1000),  # (sharing the attempt loop's 10,000+ rounds)
)
#: The durations, in seconds: name, and whether zero is refused.
DURATIONS = (
    ("wait_seconds", False),
    ("retention_seconds", True),
    ("lease_seconds", True),
    ("reconcile_timeout_seconds", True),
)

E = TypeVar("E", bound=StrEnum)


def flag(policy: Any, option: str) -> None:
    value = getattr(policy, option)
    if not isinstance(value, bool):
        raise ConfigurationError(f"{option} must be True or False, not {value!r}")


def member(enum: type[E], value: Any, option: str) -> E:
    """An enum option: its member, or its value as a string (from a config file)."""
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    choices = ", ".join(f"{m.value!r} ({enum.__name__}.{m.name})" for m in enum)
    raise ConfigurationError(f"{option} must be one of {choices}; not {value!r}")


def count(value: Any, option: str, low: int, high: int | None) -> int:
    """An integer option (a bool or a float is a mistake, not a number of bytes or fields)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigurationError(f"{option} must be an integer (int), not {value!r}")
    number = int(value)
    if number < low or (high is not None and number > high):
        bound = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ConfigurationError(f"{option} must be {bound}, not {number}")
    return number


def seconds_option(value: Any, option: str, *, positive: bool) -> float:
    """A duration: a finite number of seconds, positive or not negative, at most MAX_SECONDS."""
    if isinstance(value, timedelta):
        raise ConfigurationError(
            f"{option} must be a number of seconds, not {value!r}: pass {value.total_seconds()!r}"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(f"{option} must be a number of seconds, not {value!r}")
    number = value if isinstance(value, int | float) else float(value)
    if not math.isfinite(number):
        raise ConfigurationError(f"{option} must be a finite number of seconds, not {value!r}")
    if positive and number <= 0:
        raise ConfigurationError(f"{option} must be positive, not {value!r}")
    if number < 0:
        raise ConfigurationError(f"{option} must not be negative, not {value!r}")
    if number > MAX_SECONDS:
        raise ConfigurationError(
            f"{option} must be at most {MAX_SECONDS} seconds (100 years), not {value!r}"
        )
    return number
