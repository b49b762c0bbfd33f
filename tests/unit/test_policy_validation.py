"""A Policy checks every option when it is built: values from a config file (strings, floats)
are taken when they mean one thing, and anything else is a ConfigurationError saying what is
wrong, never a policy that misbehaves on the request path."""

from __future__ import annotations

import functools
import math
from datetime import timedelta
from fractions import Fraction
from typing import Any

import pytest

from idem_middleware import ConfigurationError, LeaseExpiry, Mode, Policy, idempotent
from idem_middleware.policy import MAX_SECONDS
from idem_middleware.reconcile import NotHappened, ReconcileContext, Reconciliation
from idem_middleware.startup import describe


async def reconcile(ctx: ReconcileContext) -> Reconciliation:
    return NotHappened()


def refused(**options: Any) -> str:
    with pytest.raises(ConfigurationError) as caught:
        Policy(**options)
    return str(caught.value)


# -- enums given as their values ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "member"), [("transactional", Mode.TRANSACTIONAL), ("lease", Mode.LEASE)]
)
def test_a_mode_given_as_its_value_is_the_enum(value: str, member: Mode) -> None:
    """The request path tests `policy.mode is Mode.TRANSACTIONAL`: a plain string there ran a
    transactional route in lease mode."""
    policy = Policy(mode=value)  # type: ignore[arg-type]
    assert policy.mode is member
    assert type(policy.mode) is Mode
    assert describe(policy).startswith(value)  # startup's log line read `.value` of a str
    assert Policy().replace(mode=value).mode is member


def test_on_lease_expiry_given_as_its_value_is_the_enum() -> None:
    policy = Policy(mode=Mode.LEASE, on_lease_expiry="takeover")  # type: ignore[arg-type]
    assert policy.on_lease_expiry is LeaseExpiry.TAKEOVER
    assert describe(policy).endswith("takeover on expiry")


@pytest.mark.parametrize(
    "value", ["bogus", "LEASE", "Transactional", "", 1, None, LeaseExpiry.UNKNOWN]
)
def test_an_unknown_mode_is_refused_naming_the_valid_ones(value: Any) -> None:
    message = refused(mode=value)
    assert message.startswith("mode must be one of 'transactional' (Mode.TRANSACTIONAL), 'lease'")
    assert repr(value) in message


@pytest.mark.parametrize("value", ["take-over", "TAKEOVER", 0, Mode.LEASE])
def test_an_unknown_lease_expiry_is_refused_naming_the_valid_ones(value: Any) -> None:
    message = refused(mode=Mode.LEASE, on_lease_expiry=value)
    assert "on_lease_expiry must be one of 'unknown' (LeaseExpiry.UNKNOWN), 'takeover'" in message


def test_the_decorator_takes_a_mode_string_too() -> None:
    @idempotent(mode="lease")
    async def pay() -> None: ...

    assert pay.__idempotency_policy__.mode is Mode.LEASE  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="mode must be one of"):
        idempotent(mode="bogus")


# -- integer options ----------------------------------------------------------------------------

INTEGERS = [
    "max_body_bytes",
    "max_response_bytes",
    "max_fields",
    "max_json_values",
    "retry_after_seconds",
    "max_serialization_retries",
]


@pytest.mark.parametrize("option", INTEGERS)
@pytest.mark.parametrize("value", [math.nan, math.inf, 1.5, 64.0, True, False, "64", None, 1e300])
def test_an_integer_option_must_be_an_int(option: str, value: Any) -> None:
    """`max_body_bytes=nan` turned the 413 cap off (no size compares larger than NaN); a float
    `retry_after_seconds=1.5` was sent as `Retry-After: 1.5`."""
    assert refused(**{option: value}) == f"{option} must be an integer (int), not {value!r}"


@pytest.mark.parametrize(
    ("option", "low"),
    [
        ("max_body_bytes", 0),
        ("max_response_bytes", 0),
        ("max_fields", 1),
        ("max_json_values", 1),
        ("retry_after_seconds", 0),
        ("max_serialization_retries", 0),
    ],
)
def test_an_integer_option_has_a_least_value(option: str, low: int) -> None:
    assert getattr(Policy(**{option: low}), option) == low
    assert f"{option} must be " in refused(**{option: low - 1})
    assert f"not {low - 1}" in refused(**{option: low - 1})


def test_retry_after_is_at_most_the_longest_duration() -> None:
    """`Retry-After: 1000000000000` is no advice a client can follow."""
    assert Policy(retry_after_seconds=MAX_SECONDS).retry_after_seconds == MAX_SECONDS
    assert refused(retry_after_seconds=MAX_SECONDS + 1) == (
        f"retry_after_seconds must be from 0 to {MAX_SECONDS}, not {MAX_SECONDS + 1}"
    )
    assert "retry_after_seconds" in refused(retry_after_seconds=10**12)


def test_serialization_retries_are_at_most_a_thousand() -> None:
    """Found by probing: 20,000 ran past the attempt loop's 10,000 rounds, which the retries
    share with a duplicate's waits: a job ended in `AssertionError("unreachable")` instead of
    its last serialization failure, a request in a 500."""
    assert Policy(max_serialization_retries=1000).max_serialization_retries == 1000
    assert refused(max_serialization_retries=1001) == (
        "max_serialization_retries must be from 0 to 1000, not 1001"
    )


def test_an_integral_number_that_is_not_an_int_is_kept_as_an_int() -> None:
    class Count(int):
        pass

    policy = Policy(max_fields=Count(5))
    assert policy.max_fields == 5
    assert type(policy.max_fields) is int


# -- durations ----------------------------------------------------------------------------------

DURATIONS = ["wait_seconds", "retention_seconds", "lease_seconds", "reconcile_timeout_seconds"]


@pytest.mark.parametrize("option", DURATIONS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_duration_must_be_finite(option: str, value: float) -> None:
    """NaN and infinity made every request a bare 500 (PostgreSQL: interval out of range), or a
    duplicate wait without bound (`wait_seconds=nan`)."""
    message = refused(**{option: value})
    assert message == f"{option} must be a finite number of seconds, not {value!r}"


@pytest.mark.parametrize("option", DURATIONS)
@pytest.mark.parametrize("value", [True, "5", None, b"5", 1j])
def test_a_duration_must_be_a_real_number(option: str, value: Any) -> None:
    assert refused(**{option: value}) == f"{option} must be a number of seconds, not {value!r}"


@pytest.mark.parametrize("option", DURATIONS)
def test_a_timedelta_is_refused_with_its_seconds_named(option: str) -> None:
    """A `timedelta` reads naturally for a duration; the refusal says the number to write."""
    value = timedelta(hours=1)
    assert refused(**{option: value}) == (
        f"{option} must be a number of seconds, not {value!r}: pass 3600.0"
    )


@pytest.mark.parametrize("option", DURATIONS)
def test_a_duration_is_at_most_a_hundred_years(option: str) -> None:
    """1e300 seconds is finite, and still past PostgreSQL's interval and timestamp range."""
    assert getattr(Policy(**{option: MAX_SECONDS}), option) == MAX_SECONDS
    assert MAX_SECONDS == 100 * 365 * 24 * 3600
    for value in (MAX_SECONDS + 1, 1e300):
        assert refused(**{option: value}) == (
            f"{option} must be at most {MAX_SECONDS} seconds (100 years), not {value!r}"
        )


@pytest.mark.parametrize(
    "option", ["retention_seconds", "lease_seconds", "reconcile_timeout_seconds"]
)
def test_a_lifetime_must_be_positive(option: str) -> None:
    assert refused(**{option: 0}) == f"{option} must be positive, not 0"
    assert refused(**{option: -1.0}) == f"{option} must be positive, not -1.0"


def test_a_wait_may_be_zero_but_not_negative() -> None:
    assert Policy(wait_seconds=0).wait_seconds == 0
    assert refused(wait_seconds=-0.5) == "wait_seconds must not be negative, not -0.5"


def test_durations_take_ints_and_other_real_numbers() -> None:
    policy = Policy(wait_seconds=2, retention_seconds=Fraction(3, 2), lease_seconds=0.25)
    assert policy.wait_seconds == 2
    assert policy.retention_seconds == 1.5
    assert type(policy.retention_seconds) is float  # (asyncpg sends a float8)
    assert policy.lease_seconds == 0.25


# -- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    ["guard", "key_required", "allow_anonymous", "accept_while_in_flight", "require_token"],
)
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_a_flag_must_be_a_bool(option: str, value: Any) -> None:
    """`allow_anonymous="false"` from a config file would be true."""
    assert refused(**{option: value}) == f"{option} must be True or False, not {value!r}"


# -- the reconciler -----------------------------------------------------------------------------


def test_a_reconciler_on_a_transactional_policy_is_refused() -> None:
    """Reconcilers are lease mode only: a transactional record is never unknown, and one that a
    reconciler released for a retry was left wedged."""
    message = refused(reconciler=reconcile)
    assert message.startswith("reconciler is a lease-mode option, and this policy is transactional")
    assert "Set mode=Mode.LEASE" in message
    assert "reconciler is a lease-mode option" in refused(
        mode="transactional", reconciler=reconcile
    )
    lease = Policy(mode=Mode.LEASE, reconciler=reconcile)
    with pytest.raises(ConfigurationError, match="lease-mode option"):
        lease.replace(mode=Mode.TRANSACTIONAL)


def test_a_reconciler_in_lease_mode_is_accepted() -> None:
    assert Policy(mode=Mode.LEASE, reconciler=reconcile).reconciler is reconcile
    assert Policy(mode="lease", reconciler=reconcile).mode is Mode.LEASE  # type: ignore[arg-type]


def test_a_reconciler_must_be_callable() -> None:
    message = refused(mode=Mode.LEASE, reconciler="myapp.reconcile")
    assert message == (
        "reconciler must be an async function of a ReconcileContext, not 'myapp.reconcile'"
    )


def test_accept_while_in_flight_works_in_either_mode() -> None:
    """(The 202 is sent by the exchange whatever the mode: it is not a lease-mode option.)"""
    assert Policy(accept_while_in_flight=True).mode is Mode.TRANSACTIONAL
    assert Policy(mode=Mode.LEASE, accept_while_in_flight=True).accept_while_in_flight


# -- field pointers -----------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["exclude_fields", "include_fields"])
@pytest.mark.parametrize("pointer", ["/a~2", "/a/~", "/~", "/a~"])
def test_a_malformed_pointer_is_refused_in_either_field_option(option: str, pointer: str) -> None:
    """exclude_fields took `/a~2` and excluded nothing; include_fields refused it."""
    message = refused(**{option: [pointer]})
    assert message.startswith(f"{option}: {pointer!r} is not a JSON Pointer (~ must be ~0 or ~1)")


@pytest.mark.parametrize("option", ["exclude_fields", "include_fields"])
def test_well_formed_pointers_and_plain_names_are_accepted(option: str) -> None:
    fields = ["trace_id", "a~2", "a/b", "/meta/trace_id", "/a~0b/~1c", "/lines/0/sku"]
    assert getattr(Policy(**{option: fields}), option) == tuple(fields)


def test_the_defaults_are_still_valid() -> None:
    policy = Policy()
    assert policy.mode is Mode.TRANSACTIONAL
    assert policy.on_lease_expiry is LeaseExpiry.UNKNOWN
    assert policy.max_body_bytes == 1024 * 1024
    assert policy.retention_seconds == 24 * 3600.0


@pytest.mark.parametrize("value", [1e-7, 0.01, 0.099])
def test_a_lease_shorter_than_a_tenth_of_a_second_is_refused(value: float) -> None:
    """A lease is renewed every third of it: one of 1e-7 s was lapsed when its claim committed
    (a duplicate took it over at once, with `LeaseExpiry.TAKEOVER`: two executions), and its
    heartbeat renewed it back to back, a round trip after another."""
    message = refused(mode=Mode.LEASE, lease_seconds=value)
    assert message.startswith(f"lease_seconds must be at least 0.1 seconds, not {value!r}: ")
    assert "The default is 30" in message
    assert Policy(mode=Mode.LEASE, lease_seconds=0.1).lease_seconds == 0.1
    assert Policy(mode=Mode.LEASE, lease_seconds=MAX_SECONDS).lease_seconds == MAX_SECONDS


def _sync_reconcile(context: object) -> object:
    return None


class _AsyncCallable:
    async def __call__(self, context: object) -> object:
        return None


class _SyncCallable:
    def __call__(self, context: object) -> object:
        return None


@pytest.mark.parametrize(
    "reconciler",
    [
        _sync_reconcile,
        functools.partial(_sync_reconcile),
        _SyncCallable(),
        lambda context: reconcile(context),
    ],
    ids=["def", "partial", "callable-object", "lambda"],
)
def test_a_plainly_sync_reconciler_is_refused_at_construction(reconciler: Any) -> None:
    """Awaiting its result would fail at every call, counted as the reconciler's failure."""
    message = refused(mode=Mode.LEASE, reconciler=reconciler)
    assert "is a plain function" in message
    assert "async def" in message


@pytest.mark.parametrize(
    "reconciler",
    [reconcile, functools.partial(reconcile), _AsyncCallable()],
    ids=["async-def", "partial", "async-callable-object"],
)
def test_an_async_reconciler_in_any_shape_is_accepted(reconciler: Any) -> None:
    assert Policy(mode=Mode.LEASE, reconciler=reconciler).reconciler is reconciler


def test_a_token_route_whose_key_is_optional_is_refused() -> None:
    # Without a key the request would run unguarded: any caller could skip the token.
    with pytest.raises(ConfigurationError, match="require_token=True with key_required=False"):
        Policy(require_token=True, key_required=False)
    assert Policy(require_token=True).key_required


def test_a_token_route_open_to_anonymous_callers_is_refused() -> None:
    """Found by probing: tokens are issued to authenticated callers only, so each anonymous
    request was told `400 token-invalid`, a problem the client could never fix."""
    with pytest.raises(ConfigurationError, match="require_token=True with allow_anonymous=True"):
        Policy(require_token=True, allow_anonymous=True)


@pytest.mark.parametrize("name", ["X-Api-Version ", "x-api-version:", "x api version", "", "ä"])
def test_an_include_headers_name_no_header_can_have_is_refused(name: str) -> None:
    # It matched no header: two requests that differ in the header were one request.
    with pytest.raises(ConfigurationError, match=r"include_headers: .* is not a header's name"):
        Policy(include_headers=(name,))
    assert Policy(include_headers=("X-Api-Version",)).include_headers == ("x-api-version",)
