"""The example app's settings, from the environment: each one it cannot use stops it at startup
with a ValueError naming the variable and what it must be (`python -m example_app` says so
before it starts anything, without a traceback)."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import httpx

from idem_middleware import ConfigurationError, Policy
from idem_middleware.cli_values import sendable_url

DEFAULT_TOKENS = "demo-a:tenant-a,demo-b:tenant-b"


class Settings(NamedTuple):
    wait_seconds: float
    lease_seconds: float
    bank_timeout: float
    #: A payout's hold of its amount, at most (a connection, a row another transaction holds)
    hold_seconds: float
    #: None: the simulator, in-process under /bank
    bank_url: str | None
    publish: bool
    tokens: dict[str, str]


def read_settings() -> Settings:
    return Settings(
        wait_seconds=env_seconds("EXAMPLE_WAIT_SECONDS", 5, zero=True, option="wait_seconds"),
        lease_seconds=env_seconds("EXAMPLE_LEASE_SECONDS", 30, option="lease_seconds"),
        bank_timeout=env_seconds("EXAMPLE_BANK_TIMEOUT", 2),
        hold_seconds=env_seconds("EXAMPLE_HOLD_SECONDS", 5),
        bank_url=env_bank_url(),
        publish=env_publish(),
        tokens=parse_tokens(os.environ.get("EXAMPLE_TOKENS", DEFAULT_TOKENS)),  # "": refused
    )


def env_seconds(name: str, default: float, *, zero: bool = False, option: str = "") -> float:
    """A number of seconds from the environment (more than 0, or 0 too), or a ValueError
    naming the variable (before: float()'s message, which did not say which). `option`: the
    Policy option it becomes, whose bounds it must meet too (before, a lease under 0.1 s
    stopped startup with the library's message, which named no variable)."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (value >= 0 if zero else value > 0) or value == math.inf:
        raise ValueError(
            f"{name}={text!r} is not a number of seconds (more than 0{', or 0' if zero else ''})"
        )
    if option:
        try:
            Policy().replace(**{option: value})
        except ConfigurationError as exc:
            raise ValueError(f"{name}={text!r} is refused: {exc}") from None
    return value


def env_publish() -> bool:
    """EXAMPLE_PUBLISH: 1 (each worker runs a publisher) or 0 (none); before, anything but 0
    (`false`, `no`) ran one."""
    text = os.environ.get("EXAMPLE_PUBLISH", "").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"EXAMPLE_PUBLISH={text!r} is 1 (each worker publishes) or 0 (none)")
    return text == "1"


def parse_tokens(spec: str) -> dict[str, str]:
    """`EXAMPLE_TOKENS="token:tenant,..."` -> {token: tenant}."""
    tokens = {}
    for item in spec.split(","):
        token, sep, tenant = item.strip().partition(":")
        if not sep or not token or not tenant:
            raise ValueError(f"EXAMPLE_TOKENS entry {item!r} is not token:tenant")
        if token in tokens:  # one token, two tenants: the last would win without a word
            raise ValueError(f"EXAMPLE_TOKENS names the token of {item!r} twice")
        tokens[token] = tenant
    return tokens


def env_bank_url() -> str | None:
    """BANK_URL: an http(s) URL with a host. Before, any text was taken (`bank:8001`, without
    its scheme): the app started, and every payout's bank call failed after its funds were
    held, each payout `unknown` until an operator stepped in."""
    text = os.environ.get("BANK_URL", "").strip()
    if not text:
        return None
    if not sendable_url(text, httpx):
        raise ValueError(
            f"BANK_URL={text!r} is not the bank's http(s) URL with a host (http://bank:8001, say)"
        )
    return text
