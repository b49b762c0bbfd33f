"""`errors.traceback_due`: a store failure's traceback is logged once per kind (the error's class
and its cause's, `__cause__` else `__context__`) in `TRACEBACK_EVERY_SECONDS`, by the monotonic
clock, and the kinds it remembers stay few. (The outage test meets two kinds that differ in both
their class and their cause, and never reaches the minute's end.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from idem_middleware import errors
from idem_middleware.errors import StoreClosed, StoreError, traceback_due


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(errors, "time", SimpleNamespace(monotonic=fake.monotonic))
    monkeypatch.setattr(errors, "_traced", {})
    return fake


def _caused(
    cls: type[StoreError], cause: BaseException | None, *, implicit: bool = False
) -> StoreError:
    exc = cls("down")
    if implicit:
        exc.__context__ = cause
    else:
        exc.__cause__ = cause
    return exc


def test_one_traceback_per_kind_a_minute_by_the_monotonic_clock(clock: _Clock) -> None:
    assert traceback_due(StoreError("down"))
    clock.now += 59.9
    assert not traceback_due(StoreError("down"))
    clock.now += 0.1  # a minute after the first: due again
    assert traceback_due(StoreError("down"))
    clock.now += 59.0
    assert not traceback_due(StoreError("down"))


def test_the_kind_is_the_class_and_the_causes_class(clock: _Clock) -> None:
    assert traceback_due(_caused(StoreError, TimeoutError()))
    assert traceback_due(_caused(StoreError, OSError()))  # another cause
    assert traceback_due(_caused(StoreClosed, TimeoutError()))  # another class, the same cause
    assert traceback_due(StoreError("down"))  # no cause at all
    assert not traceback_due(_caused(StoreError, TimeoutError()))
    assert not traceback_due(_caused(StoreClosed, TimeoutError()))


def test_an_implicit_cause_counts_and_an_explicit_one_wins(clock: _Clock) -> None:
    assert traceback_due(StoreError("down"))
    assert traceback_due(_caused(StoreError, OSError(), implicit=True))  # raised while handling
    assert traceback_due(_caused(StoreError, ValueError()))  # `raise ... from` alone
    both = _caused(StoreError, ValueError())
    both.__context__ = OSError()
    assert not traceback_due(both)  # the kind of `from ValueError`: logged already


def test_kinds_met_in_turn_are_each_remembered(clock: _Clock) -> None:
    assert traceback_due(_caused(StoreError, TimeoutError()))
    assert traceback_due(_caused(StoreError, OSError()))
    assert not traceback_due(_caused(StoreError, TimeoutError()))
    assert not traceback_due(_caused(StoreError, OSError()))


def test_the_kinds_remembered_stay_few(clock: _Clock) -> None:
    for i in range(3 * errors._KINDS_KEPT):
        cause = type(f"Cause{i}", (Exception,), {})()
        assert traceback_due(_caused(StoreError, cause))
        assert len(errors._traced) <= errors._KINDS_KEPT
