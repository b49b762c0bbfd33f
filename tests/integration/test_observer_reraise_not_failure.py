"""An observer's timer that lets the step's own exception through (as OpenTelemetryObserver's
does, re-raising it after recording it on the span; here a class whose `__exit__` raises it)
has not failed: nothing is logged about the observer, and the step's exception reaches the
caller as it was. Blamed on the observer, such a timer logged a WARNING naming it for every
step that raised (each duplicate's ClaimBusy among them)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest

from idem_middleware.observe import Event, Observers


class Reraising:
    def __init__(self) -> None:
        self.ended: list[type[BaseException]] = []

    def event(self, event: Event, attributes: Mapping[str, Any]) -> None:
        pass

    def timed(self, name: str, attributes: Mapping[str, Any]) -> _Timer:
        return _Timer(self.ended)


class _Timer:
    """A timer written as a class, whose `__exit__` raises the step's exception again itself
    (a generator-based one's re-raise is absorbed by contextlib before the fan sees it)."""

    def __init__(self, ended: list[type[BaseException]]) -> None:
        self.ended = ended

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self.ended.append(type(exc))
            raise exc


class StepFailed(Exception):
    pass


def test_a_timer_that_reraises_the_steps_exception_is_not_blamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="idem_middleware")
    observer = Reraising()
    fan = Observers([observer])
    with pytest.raises(StepFailed), fan.timed("claim", {"operation": "POST /x"}):
        raise StepFailed("the step's own")
    assert observer.ended == [StepFailed]
    assert "failed" not in caplog.text, caplog.text
    # A later failure of the observer's own is still its first: logged at WARNING.
    assert not fan._failed
