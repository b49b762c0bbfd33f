"""The kill switch and `enabled=`: docs/operating.md promises that IDEM_MIDDLEWARE_DISABLED=1
turns the middleware into a pass-through. An app that passed `enabled=True` (from its own
settings, whose default is on) kept it guarding through the operator's switch without a word,
and a switch that was neither on nor off was not refused. Now the switch wins, with a warning
naming both, and a garbled one is refused whatever `enabled` says."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.applications import Starlette

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.middleware import KILL_SWITCH_ENV


def make(**options: Any) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)


@pytest.mark.parametrize("value", ["1", "true", " YES ", "on"])
def test_the_switch_on_disables_the_middleware_even_with_enabled_true(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(KILL_SWITCH_ENV, value)
    caplog.set_level(logging.WARNING, "idem_middleware")
    assert make(enabled=True).enabled is False
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(KILL_SWITCH_ENV in m and "enabled=True" in m for m in warned), warned


@pytest.mark.parametrize("enabled", [True, False, None])
def test_a_garbled_switch_is_refused_whatever_enabled_says(
    monkeypatch: pytest.MonkeyPatch, enabled: bool | None
) -> None:
    monkeypatch.setenv(KILL_SWITCH_ENV, "disable")
    with pytest.raises(ConfigurationError, match=KILL_SWITCH_ENV):
        make(enabled=enabled)


@pytest.mark.parametrize(
    ("value", "enabled", "expected"),
    [
        ("", True, True),
        ("0", True, True),
        ("off", False, False),
        ("", False, False),
        ("1", False, False),
        ("", None, True),
    ],
)
def test_a_switch_that_is_off_leaves_enabled_as_given(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str,
    enabled: bool | None,
    expected: bool,
) -> None:
    monkeypatch.setenv(KILL_SWITCH_ENV, value)
    caplog.set_level(logging.WARNING, "idem_middleware")
    assert make(enabled=enabled).enabled is expected
    assert not [r for r in caplog.records if KILL_SWITCH_ENV in r.getMessage()]
