"""The middleware's constructor arguments and its kill switch: what can be told wrong before the
first request, told at construction (each of these failed every request, or guarded nothing)."""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Sequence

from .errors import ConfigurationError
from .policy import Policy, seconds_option

logger = logging.getLogger("idem_middleware")

#: Setting this environment variable to 1/true/yes turns the middleware into a pass-through.
KILL_SWITCH_ENV = "IDEM_MIDDLEWARE_DISABLED"

_SWITCH_ON = frozenset({"1", "true", "yes", "on"})
_SWITCH_OFF = frozenset({"", "0", "false", "no", "off"})


def switched(enabled: bool | None) -> bool:
    """Whether the middleware guards: `enabled` (None: on), unless the kill switch is on, which
    always wins. An app's `enabled=True` (read from its own settings, say) kept the middleware
    guarding through an operator's IDEM_MIDDLEWARE_DISABLED=1 without a word, and a switch that
    was neither on nor off was ignored; it is refused whatever `enabled` says."""
    if not kill_switch_on():
        return True if enabled is None else enabled
    if enabled is True:
        logger.warning(
            "idempotency: %s is on, so the middleware is disabled (a pass-through), although "
            "the app passed enabled=True: the kill switch wins. Unset it to guard again",
            KILL_SWITCH_ENV,
        )
    return False


def kill_switch_on() -> bool:
    value = os.environ.get(KILL_SWITCH_ENV, "").strip().lower()
    if value in _SWITCH_ON:
        return True
    if value in _SWITCH_OFF:
        return False
    raise ConfigurationError(
        f"{KILL_SWITCH_ENV}={value!r} is neither on (1, true, yes, on) nor off (0, false, no, "
        "off, or unset)"
    )


#: A scheme, then printable ASCII without spaces, ending in a character that is not a letter
#: or digit (`/`, `:`, `#`, `=`, ...): the problem's name is appended to it.
_PROBLEM_BASE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[!-~]*[!-/:-@\[-`{-~]")


def check_problem_base(problem_base: object) -> None:
    """The middleware's `problem_base`, and a library route's own (`status_route`'s,
    `token_route`'s)."""
    if not isinstance(problem_base, str) or not _PROBLEM_BASE.fullmatch(problem_base):
        # "" gave types such as `key-missing`, relative references a client resolves against
        # the request's URL; a base ending in a letter glued the name onto its last word.
        raise ConfigurationError(
            "problem_base must be an absolute URI prefix ending in a separator, such as "
            f"'https://example.com/problems/' or 'urn:example:problem:', not {problem_base!r}"
        )


#: A URI path (RFC 3986's characters of a path; no query or fragment).
_PATH = re.compile(r"/[A-Za-z0-9\-._~%!$&'()*+,;=:@/]*")
#: An HTTP method: a token (RFC 9110). Anything else, `" post "` or `""`, was kept and never
#: matched a request's method.
METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: The methods of HTTP's own (RFC 9110, and PATCH); a client may send any other token.
HTTP_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)


def check_arguments(
    store: object,
    default_policy: object,
    acquire_timeout: object,
    enabled: object,
    status_path: object,
    problem_base: object,
    observers: object,
) -> None:
    """What the constructor can tell is wrong, told now: each of these failed every request.
    (The tenant resolver is checked where every edge makes its `Tenants`: tenant.py.)"""
    if isinstance(store, type):
        # (a MemoryStore class passed every check and failed every request; PostgresStore's
        # failed at startup with a TypeError naming neither)
        raise ConfigurationError(
            "store must be a store instance (PostgresStore(...) or MemoryStore()), not the "
            f"class {store.__name__}"
        )
    if not callable(getattr(store, "transaction", None)):
        raise ConfigurationError(f"store must be a PostgresStore or a MemoryStore, not {store!r}")
    if default_policy is not None and not isinstance(default_policy, Policy):
        raise ConfigurationError(f"default_policy must be a Policy, not {default_policy!r}")
    if default_policy is not None and default_policy.operation is not None:
        raise ConfigurationError(
            f"default_policy has operation={default_policy.operation!r}: every route it guards "
            "would share one key space. Pin a name per route, with @idempotent(operation=...) "
            "or policies={...}"
        )
    seconds_option(acquire_timeout, "acquire_timeout", positive=True)
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigurationError(f"enabled must be True, False or None, not {enabled!r}")
    if not isinstance(status_path, str) or not _PATH.fullmatch(status_path):
        # (a space, `?` or `#` made a Location no client could follow as meant)
        raise ConfigurationError(
            f"status_path must be a path ('/...', URI characters, no query), not {status_path!r}"
        )
    check_problem_base(problem_base)
    if observers is None:
        return
    for observer in observers if isinstance(observers, Sequence) else (observers,):
        _check_observer(observer)


def _check_observer(observer: object) -> None:
    """Each of these passed a check for callable `event` and `timed`, then failed at every call
    (each failure logged, the metrics lost) or, an `async def event`, did nothing at all."""
    if isinstance(observer, type):
        raise ConfigurationError(
            f"observers: {observer.__name__} is a class; give an instance, {observer.__name__}(...)"
        )
    event = getattr(observer, "event", None)
    timed = getattr(observer, "timed", None)
    if not (callable(event) and callable(timed)):
        raise ConfigurationError(
            f"observers: {observer!r} is not an Observer (it needs event() and timed())"
        )
    name = type(observer).__name__
    # (an object given as `event`, its `async def __call__`: as never awaited)
    call = event if inspect.isroutine(event) else type(event).__call__
    if inspect.iscoroutinefunction(inspect.unwrap(event)) or inspect.iscoroutinefunction(call):
        raise ConfigurationError(
            f"observers: {name}.event is async; the middleware calls it without awaiting it, "
            "so it must be a plain function (hand the work to a task or a queue of your own)"
        )
    timer = inspect.unwrap(timed)
    if inspect.iscoroutinefunction(timer) or inspect.isasyncgenfunction(timer):
        raise ConfigurationError(
            f"observers: {name}.timed is async (an async function or an "
            "@asynccontextmanager); it must return a plain context manager "
            "(@contextlib.contextmanager)"
        )


def named_route(template: str) -> bool:
    """A policy's route: "/path", or "host/path" for a route under a Host."""
    return template.startswith("/") or (
        "/" in template and not template.startswith(" ") and " " not in template.split("/")[0]
    )
