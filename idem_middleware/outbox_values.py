"""The outbox's values, checked before any statement: event texts, durations, counts, the
sender and a list of ids; and a failed send's error as the outbox records it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from typing import Any

from .errors import ConfigurationError
from .policy import seconds_option

#: The most a count may be (an attempt count is a PostgreSQL integer).
MAX_INT = 2**31 - 1


def check_text(value: Any, name: str) -> None:
    """A str PostgreSQL's `text` stores as it is: no NUL, no unpaired surrogate."""
    if not isinstance(value, str):
        raise TypeError(f"an event's {name} is a str, not {type(value).__name__}")
    if "\x00" in value:
        raise ValueError(f"an event's {name} holds a NUL character, which PostgreSQL cannot store")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError(f"an event's {name} holds an unpaired surrogate") from None


def error_text(exc: BaseException) -> str:
    """A failed send's error as `last_error` can hold it: 500 characters of text PostgreSQL
    stores (no NUL, no unpaired surrogate). Anything else and the failure went unrecorded: no
    backoff, and the event parked in the end as one no publisher finished sending."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose str() fails
        text = type(exc).__name__
    text = text[:500].replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def answer_error(accepted: object) -> str | None:
    """A sender's answer as a send's error: None (delivered) for True or None, the reason for
    False or anything else. Anything but a bool or None is no delivery: what the sender got
    back (`return await client.post(...)`: a 503's Response as well as a 200's) or a coroutine
    it did not await (`return client.post(...)`: nothing was sent). Taken for a delivery, the
    event was marked sent and never sent again."""
    if accepted is None or accepted is True:
        return None
    if accepted is False:
        return "the sender reported failure"
    if inspect.iscoroutine(accepted):
        accepted.close()  # (never awaited: closed, not left to warn when collected)
    return (
        f"the sender returned a {type(accepted).__name__}, not True, False or None: a send "
        "counts as delivered only when the sender returns True or None"
    )


def seconds(value: float, name: str, positive: bool) -> float:
    """A finite duration (positive, or not negative): ValueError otherwise."""
    try:
        return seconds_option(value, name, positive=positive)
    except ConfigurationError as exc:
        raise ValueError(str(exc)) from None


def whole_count(count: Any, name: str) -> int:
    """A whole number from 1 to MAX_INT: ValueError otherwise."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_INT:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_INT}, not {count!r}")
    return count


def checked_sender(sender: Any) -> Any:
    """A Publisher's sender: callable (None or a URL's str failed every send, each attempt
    counted, until the event was parked)."""
    if not callable(sender):
        raise TypeError(
            f"a Publisher's sender is a function of an OutboxEvent, async best "
            f"(webhook_sender(client, url), say), not {type(sender).__name__}"
        )
    return sender


def event_ids_of(event_ids: Any) -> list[str]:
    """A list of event ids (any iterable of them), each a str: one id given alone (a str) was
    read as its characters, each an id, and an unrelated event named by one letter was
    requeued."""
    if isinstance(event_ids, str | bytes | bytearray) or not isinstance(event_ids, Iterable):
        raise TypeError(f"event_ids is a list of event ids, not {type(event_ids).__name__}")
    ids = list(event_ids)
    if not all(isinstance(event_id, str) for event_id in ids):
        raise TypeError("event_ids is a list of event ids, each a str")
    return ids


def checked_stop(stop: Any) -> asyncio.Event:
    """`Publisher.run(stop=...)`: an event whose `wait` is awaited (asyncio's, anyio's), or None
    (never set). A threading.Event was taken, and its blocking `wait` froze the event loop for
    each idle pause."""
    if stop is None:
        return asyncio.Event()
    awaited = inspect.iscoroutinefunction(getattr(type(stop), "wait", None))
    if not awaited or not callable(getattr(stop, "is_set", None)):
        raise TypeError(
            f"stop is an asyncio.Event (or an anyio one, or None), not a {type(stop).__name__}"
        )
    return stop  # type: ignore[no-any-return]


def cancelling() -> int:
    """How many cancellations of this task are under way (`Task.cancelling`; 0 outside one)."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


def cancelled_since(before: int) -> None:
    """CancelledError if this task was cancelled since `cancelling()` was `before` and the
    cancellation was caught (a sender that retries on any error, CancelledError too, then
    delivers): a publisher went on reserving and sending, idled for ever, and a shutdown that
    awaited it hung. Raised once the send is marked, so that it is not sent again."""
    if cancelling() > before:
        raise asyncio.CancelledError


def is_httpx(value: Any, name: str) -> bool:
    """Whether `value` is an instance of httpx's class `name` (False without httpx)."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is optional
        return False
    return isinstance(value, getattr(httpx, name))
