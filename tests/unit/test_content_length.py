"""A declared Content-Length against the policy's cap, read before any byte of the body: refused
exactly when its number is over the cap, whatever the cap, the digits and the leading zeros (a
short number under a cap of a million or more is let through without being parsed)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idem_middleware import Policy
from idem_middleware.errors import ProblemKind, RequestRejected
from idem_middleware.exchange import Exchange
from idem_middleware.keys import header_map

CAPS = [1, 100, 65_536, 999_998, 999_999, 1_000_000, 1_048_576, 10**12]


def _verdict(cap: int, declared: bytes) -> str:
    headers = [(b"content-type", b"application/json"), (b"content-length", declared)]
    scope: dict[str, Any] = {"type": "http", "headers": headers}
    exchange = Exchange.__new__(Exchange)
    exchange.policy = Policy(max_body_bytes=cap)
    exchange.scope = scope
    for by_name in (header_map(scope), None):  # (headers by name, and scanned)
        exchange.by_name = by_name
        try:
            exchange.body_headers()
            verdict = "read"
        except RequestRejected as exc:
            verdict = exc.kind.value
        if by_name is not None:
            first = verdict
    assert verdict == first
    return verdict


def _expected(cap: int, declared: bytes) -> str:
    if not declared.isdigit():
        return ProblemKind.BODY_INVALID.value
    digits = declared.lstrip(b"0") or b"0"
    over = len(digits) > 30 or int(digits) > cap  # (int() refuses over 4,300 digits)
    return ProblemKind.BODY_TOO_LARGE.value if over else "read"


@pytest.mark.parametrize("cap", CAPS)
def test_the_cap_is_held_at_its_edges(cap: int) -> None:
    for number in {0, 1, cap - 1, cap, cap + 1, 99_999, 999_999, 1_000_000, 10**7}:
        for declared in (str(number).encode(), b"000000" + str(number).encode()):
            assert _verdict(cap, declared) == _expected(cap, declared), (cap, declared)
    for declared in (b"9" * 31, b"0" * 40 + b"5", b"1" + b"0" * 5000, b"+5", b"1_000", b""):
        assert _verdict(cap, declared) == _expected(cap, declared), (cap, declared[:40])


@settings(database=None, max_examples=300, deadline=None)  # (a loaded CI machine)
@given(
    st.one_of(st.sampled_from(CAPS), st.integers(min_value=1, max_value=10**15)),
    st.one_of(
        st.integers(min_value=0, max_value=10**16).map(lambda n: str(n).encode()),
        st.tuples(st.integers(0, 8), st.integers(0, 10**8)).map(
            lambda zn: b"0" * zn[0] + str(zn[1]).encode()
        ),
        st.binary(max_size=12),
    ),
)
def test_any_declared_length_is_refused_exactly_when_over_the_cap(
    cap: int, declared: bytes
) -> None:
    assert _verdict(cap, declared) == _expected(cap, declared)
