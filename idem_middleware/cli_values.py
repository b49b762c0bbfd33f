"""What the command line's options take (cli.py builds the parser): type functions that check a
value, each message naming the environment variable it came from, and defaults read from the
environment."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from .cli_connect import UsageError
from .errors import ConfigurationError
from .ops import checked_note
from .policy import seconds_option
from .store.migrations import MAX_LOCK_TIMEOUT_SECONDS

DSN_ENV = "IDEM_DATABASE_URL"
DSN_ENVS = (DSN_ENV, "DATABASE_URL")


def env_default(name: str, fallback: str | None = None) -> str | None:
    """The variable's text; `fallback` when it is unset or empty, as for every variable (an
    empty `IDEM_TENANT=` left in an env file once listed the anonymous tenant "" alone, and
    said "no records")."""
    return os.environ.get(name) or fallback


class _FromEnv(str):
    """An option's default read from an environment variable, still text.

    argparse converts a text default with the option's `type` only when the option is not
    given, and turns a failure into a usage error (exit 2). A type function names the variable
    when the text came from one.
    """

    env: str

    def __new__(cls, text: str, env: str) -> _FromEnv:
        self = super().__new__(cls, text)
        self.env = env
        return self


def common_options(top: bool) -> argparse.ArgumentParser:
    """--dsn and --json, accepted before the command and after it.

    Below the top level their default is SUPPRESS, so an option given before the command is
    not overwritten by the command's own default.
    """
    common = argparse.ArgumentParser(add_help=False)
    # (Text that names its variable: a DSN asyncpg cannot parse is told as that variable's.)
    found = next(
        ((name, os.environ[name]) for name in DSN_ENVS if os.environ.get(name, "").strip()), None
    )  # (blank: unset, as for every variable)
    dsn_default = None if found is None else _FromEnv(found[1], found[0])
    common.add_argument(
        "--dsn",
        default=dsn_default if top else argparse.SUPPRESS,
        metavar="URL",
        help=f"PostgreSQL URL (env {DSN_ENV}, then DATABASE_URL)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=env_flag("IDEM_JSON") if top else argparse.SUPPRESS,
        help="machine-readable output: a JSON object, or one per line for lists (env IDEM_JSON=1)",
    )
    return common


class StoreOnce(argparse._StoreAction):
    """An option of `show`, `resolve` and `reopen` given twice is refused (exit 2): argparse's
    last one won, silently, and `resolve --key a ... --key b` moved another record (`--to
    succeeded ... --to retry` to another state) than the one the operator also named."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, self.default)
        if option_string is not None and given is not self.default:
            raise argparse.ArgumentError(
                self, f"given more than once ({given!r:.60} and {values!r:.60}): give it once"
            )
        super().__call__(parser, namespace, values, option_string)


def env_typed(name: str, fallback: object) -> object:
    """The default of an option with a `type`: the variable's text if it is set (not empty),
    converted and checked by argparse when the option is not given; else `fallback`."""
    text = os.environ.get(name, "")
    return _FromEnv(text, name) if text.strip() else fallback


def _shown(text: str) -> str:
    """The argument in a type function's message: where it came from, if from the environment."""
    return f"{text!r} (from {text.env})" if isinstance(text, _FromEnv) else repr(text)


_FLAG_ON = frozenset({"1", "true", "yes", "on"})
_FLAG_OFF = frozenset({"", "0", "false", "no", "off"})


def env_flag(name: str) -> bool | _FromEnv:
    """On or off, as the kill switch reads its variable; anything else is kept (a _FromEnv)
    for `main` to refuse, so that `--help` still works whatever the variable holds."""
    value = os.environ.get(name, "").strip().lower()
    if value in _FLAG_ON or value in _FLAG_OFF:
        return value in _FLAG_ON
    return _FromEnv(value, name)


def checked_flag(parser: argparse.ArgumentParser, value: object) -> bool:
    if isinstance(value, _FromEnv):  # (before: IDEM_JSON=on printed text for a JSON reader)
        parser.error(
            f"{value.env}={str(value)!r} is neither on (1, true, yes, on) nor off (0, false, "
            "no, off, or empty)"
        )
    return bool(value)


#: The largest count an option takes: the database's counters are 32-bit integers.
_MAX_COUNT = 2**31 - 1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a whole number") from None
    if not 1 <= value <= _MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{_shown(text)} must be from 1 to {_MAX_COUNT}")
    return value


def _seconds(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a number of seconds") from None
    try:
        return seconds_option(value, "it", positive=not zero)  # (a Policy's duration rule)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(f"{_shown(text)}: {exc}") from None


def positive_seconds(text: str) -> float:
    """Seconds, finite and > 0 (a bound, or a pause: 0 would be a busy loop)."""
    return _seconds(text, zero=False)


def lock_timeout_seconds(text: str) -> float:
    """`migrate --lock-timeout`: seconds > 0, at most what the server's `lock_timeout` takes (more
    was accepted here, then refused by the server after connecting, exit 1)."""
    value = _seconds(text, zero=False)
    if value > MAX_LOCK_TIMEOUT_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{_shown(text)} is more than the server's longest lock_timeout "
            f"({MAX_LOCK_TIMEOUT_SECONDS:g} s)"
        )
    return value


def margin_seconds(text: str) -> float:
    """Seconds, finite and >= 0."""
    return _seconds(text, zero=True)


def utf8_text(text: str) -> str:
    """Text the database can hold: bytes that are not UTF-8 (which Python reads from the command
    line as lone surrogates) or a NUL would fail as a driver's error, exit 1, after connecting."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raw = text.encode(errors="surrogateescape")
        raise argparse.ArgumentTypeError(f"{raw!r} is not UTF-8 text") from None
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{_shown(text)} holds a NUL character") from None
    return text


def audit_note(text: str) -> str:
    text = utf8_text(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("an audit note is required (it goes into the audit trail)")
    try:
        checked_note(text)  # (the library's own rule: its length)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def operation_hint(operation: str | None) -> str:
    """What to add to an answer that found nothing under `operation`, when it is not named as the
    middleware names operations, "METHOD /template" with the method upper case (as routes
    serve methods): `post /refunds` found nothing and said only that. Empty otherwise."""
    if operation is None:
        return ""
    method, _, template = operation.partition(" ")
    if method and template.startswith("/") and method == method.upper():
        return ""
    named = f"{method.upper()} {template}" if method and template.startswith("/") else ""
    guess = f": did you mean {named!r}?" if named and named != operation else ""
    return (
        f' (an operation is named "METHOD /template", the method upper case, as in '
        f'"POST /payouts"{guess})'
    )


_terminated = [False]


def terminated() -> bool:
    """Whether SIGTERM stopped the command (see `terminate_as_interrupt`)."""
    return _terminated[0]


def terminate_as_interrupt() -> None:
    """Make SIGTERM (`timeout`, systemd, a CI runner stopping the command) stop a command as
    Ctrl-C does: the running statement is cancelled on the server before the process exits.
    Killed by SIGTERM's default action, a `resolve` waiting for a row another session held left
    its statement to the server, which applied it once the row was free, after the operator
    had been told nothing. (`outbox publish` installs its own handlers while it runs.)"""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        _terminated[0] = True
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)  # asyncio.run's: cancels the command's task
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def webhook_httpx(url: str) -> Any:
    """httpx, for `outbox publish`, which only the webhook publisher needs (the extra `httpx`),
    once `url` is one it can send to: a UsageError otherwise. Without the check every send
    failed, each a counted attempt, until every due event was parked; without the extra the
    command said only "No module named 'httpx'"."""
    try:
        import httpx
    except ImportError as exc:
        raise UsageError(
            f"outbox publish sends with httpx, which is not installed ({exc}): "
            "pip install 'idem-middleware[httpx]'"
        ) from None
    if not sendable_url(url, httpx):
        # (Not shown: a webhook URL may hold a credential, in its user part, path or query.)
        where = f" (from {url.env})" if isinstance(url, _FromEnv) else ""
        raise UsageError(
            f"--url{where} is not an http:// or https:// URL with a host and a port in 1-65535"
            " (the URL is not shown: it may hold a credential)"
        )
    return httpx


def sendable_url(text: str, httpx: Any) -> bool:
    """An http(s) URL with a host and a port in 1-65535 that httpx takes (a bracket left open,
    a space in the host, port 0 or 99999: each parsed, or not, only when the first event is
    sent)."""
    try:
        url = urlsplit(text)
        port = url.port
        parsed = httpx.URL(text)
    except (ValueError, httpx.InvalidURL):
        return False
    return (
        url.scheme in ("http", "https")
        and bool(url.hostname)
        and port != 0
        and parsed.host != ""
        and not any(c.isspace() or not c.isprintable() for c in url.netloc)
    )


def finite(value: Any) -> Any:
    """`value` with every float that is not finite (an age from a timestamp set to 'infinity'
    or '-infinity' by hand) written as the string JavaScript and Python's float() read back,
    "Infinity", "-Infinity" or "NaN", in the dicts and lists it holds too: JSON has no such
    number, and json.dumps wrote a bare `Infinity` that strict parsers refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_line(data: Any) -> str:
    """`data` as one line of JSON that any parser reads (`finite`)."""
    return json.dumps(finite(data), default=str, sort_keys=True, allow_nan=False)


def shown_age(age: float | None) -> str:
    """An age in seconds as `stats` prints it for a person: `-` for none."""
    return "-" if age is None else f"{age:.0f}s" if math.isfinite(age) else str(finite(age))
