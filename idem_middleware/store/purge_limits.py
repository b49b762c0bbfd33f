"""The counts both stores' `purge` take, checked alike."""

from __future__ import annotations

import inspect

#: The most rows a purge batch, or batches a purge, may be given (`LIMIT` takes more, but the
#: command line's counts stop here too).
MAX_PURGE_COUNT = 2**31 - 1


def check_progress(
    progress: object,
    caller: str = "purge",
    name: str = "progress",
    called: str = "with the count so far after each batch",
) -> None:
    """A purge's `progress` (and `on_limit`) is a plain function, called as it goes: an async
    one was taken, called, and its coroutine never run (nothing reported); a value that is
    none failed only once its batches had committed."""
    if progress is None:
        return
    if not callable(progress):
        raise ValueError(
            f"{caller}: {name} is called {called} (a callable, or None), not the "
            f"{type(progress).__name__} {progress!r:.60}"
        )
    if inspect.iscoroutinefunction(progress):
        raise ValueError(
            f"{caller}: {name} is called {called}, a plain function: an async one, "
            f"{progress!r:.60}, would never run"
        )


def check_on_limit(on_limit: object) -> None:
    """`purge(on_limit=...)`, as `progress`."""
    check_progress(on_limit, "purge", "on_limit", 'with "tokens" or "waiters" at their limit')


def check_purge_limits(batch_size: object, max_batches: object) -> None:
    """Both stores' `purge` take the same counts: whole numbers from 1 to MAX_PURGE_COUNT.
    Anything else is refused before any row is touched (ValueError), rather than read as no
    limit, as a negative slice, or sent to the server as a LIMIT it rejects."""
    for name, value in (("batch_size", batch_size), ("max_batches", max_batches)):
        if type(value) is not int or not 1 <= value <= MAX_PURGE_COUNT:
            raise ValueError(
                f"purge: {name} must be a whole number from 1 to {MAX_PURGE_COUNT}, not {value!r}"
            )
