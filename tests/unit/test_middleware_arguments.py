"""Misconfiguration fails at construction, where the information exists: each of these used to
be accepted and then fail every request (a bare 500), or be ignored without a word."""

from __future__ import annotations

import math
from typing import Any

import pytest
from starlette.applications import Starlette

import idem_middleware.middleware as middleware_module
from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.middleware import KILL_SWITCH_ENV


def make(**options: Any) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(Starlette(), **{"store": MemoryStore(), **options})


def _shown(value: Any) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): a set's items
    sorted, an object's address left out."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(repr, value))) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return "object()" if type(value) is object else repr(value)


@pytest.mark.parametrize(
    "options",
    [
        {"store": None},
        {"store": "postgresql://localhost/db"},
        {"default_policy": {"wait_seconds": 1}},
        {"tenant_resolver": None},
        {"tenant_resolver": "tenant-a"},
        {"acquire_timeout": 0},
        {"acquire_timeout": -1},
        {"acquire_timeout": math.nan},
        {"acquire_timeout": math.inf},
        {"acquire_timeout": "10"},
        {"acquire_timeout": None},
        {"acquire_timeout": True},
        {"enabled": "yes"},
        {"status_path": "idempotency/status"},
        {"status_path": None},
        {"status_path": "/idempotency status"},  # a Location no client follows as meant
        {"status_path": "/status?v=1"},  # the key's query appended after a second `?`
        {"methods": {"", "POST"}},  # never a request's method: guarded nothing
        {"methods": [" post "]},
        {"methods": ["PO ST"]},
        {"problem_base": 5},
        {"problem_base": ""},  # types such as `key-missing`: relative references
        {"problem_base": "/problems/"},
        {"problem_base": "https://example.com/problems"},  # `.../problemskey-missing`
        {"problem_base": "https://example.com/my problems/"},
        {"observers": 5},
        {"observers": [object()]},
    ],
    ids=lambda options: "-".join(f"{k}={_shown(v)}" for k, v in options.items()),
)
def test_an_argument_that_cannot_work_is_refused_at_construction(options: dict[str, Any]) -> None:
    name = next(iter(options))
    with pytest.raises(ConfigurationError, match=name):
        make(**options)


def test_the_arguments_that_work_are_accepted() -> None:
    made = make(acquire_timeout=2, enabled=False, observers=[], status_path="/status")
    assert made.acquire_timeout == 2
    assert made.enabled is False
    for base in ("https://example.com/problems/", "urn:example:problem:", "https://x/p#"):
        assert make(problem_base=base).problem_base == base


@pytest.mark.parametrize(
    ("value", "enabled"),
    [("1", False), ("TRUE", False), (" on ", False), ("", True), ("0", True), ("off", True)],
)
def test_the_kill_switch_reads_on_and_off(
    monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool
) -> None:
    monkeypatch.setenv(KILL_SWITCH_ENV, value)
    assert make().enabled is enabled


@pytest.mark.parametrize("value", ["y", "disable", "disabled", "ture", "2"])
def test_a_kill_switch_value_that_is_neither_on_nor_off_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(KILL_SWITCH_ENV, value)
    with pytest.raises(ConfigurationError, match=KILL_SWITCH_ENV):
        make()


async def test_a_startup_check_that_cannot_run_fails_every_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not only a ConfigurationError: a check that breaks (a policy value it cannot describe,
    say) fails each request as a failed check does, instead of being skipped after the first."""

    def broken(mw: object, app: object, scope: object = None) -> None:
        raise AttributeError("'str' object has no attribute 'value'")

    monkeypatch.setattr(middleware_module, "check_app", broken)
    mw = make()
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "app": None}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError("nothing is sent")

    for _ in range(2):
        with pytest.raises(ConfigurationError, match="startup check failed"):
            await mw(scope, receive, send)
