"""Exact JSON numbers, and the caps that bound the fingerprint's work per request."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from idem_middleware import ConfigurationError, Policy
from idem_middleware.errors import ProblemKind, RequestRejected
from idem_middleware.fingerprint import (
    canonical_body,
    canonical_json,
    parse_json_strict,
)
from tests.unit.test_fingerprint import fingerprint

JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"


def refused(**overrides: Any) -> RequestRejected:
    with pytest.raises(RequestRejected) as caught:
        fingerprint(**overrides)
    return caught.value


# Exact numbers


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"9007199254740993.0", b"9007199254740992"),
        (b"0.1", b"0.1000000000000000055511151231257827"),
        (b"1e-400", b"0"),
        (b"333333333.33333329", b"333333333.3333333"),
        (b"123456789012345678901234", b"123456789012345678901235"),
        (b"1.00000000000000000001", b"1"),
    ],
)
def test_numbers_a_double_cannot_tell_apart_give_different_digests(
    first: bytes, second: bytes
) -> None:
    assert fingerprint(body=b'{"n":' + first + b"}") != fingerprint(body=b'{"n":' + second + b"}")


@pytest.mark.parametrize(
    ("spellings", "canonical"),
    [
        ([b"1", b"1.0", b"10e-1", b"0.1E1", b"1.000"], b"1"),
        ([b"0", b"-0", b"0.0", b"-0.0", b"0e5"], b"0"),
        ([b"1e21", b"1E+21", b"1000000000000000000000"], b"1e+21"),
        ([b"4.50", b"4.5", b"45e-1"], b"4.5"),
        ([b"0.000001", b"1e-6"], b"0.000001"),
        ([b"9007199254740993"], b"9007199254740993"),
        # An integer no double holds, spelt as json.loads reads a double: marked (fingerprint.md).
        ([b"9007199254740993.0", b"90071992547409930e-1"], b"9007199254740993.0"),
        ([b"9007199254740992.0", b"9007199254740992"], b"9007199254740992"),
        ([b"0.1000000000000000055511151231257827"], b"0.1000000000000000055511151231257827"),
        ([b"-1.5e-7", b"-0.00000015"], b"-1.5e-7"),
        ([b"123456789012345678901234"], b"1.23456789012345678901234e+23"),
    ],
)
def test_equal_values_share_one_exact_canonical_form(
    spellings: list[bytes], canonical: bytes
) -> None:
    for spelling in spellings:
        assert canonical_body(JSON, b"[" + spelling + b"]")[1] == b"[" + canonical + b"]"


def test_fractions_parse_to_exact_decimals() -> None:
    assert parse_json_strict(b"[0.1, 7]") == [Decimal("0.1"), 7]
    assert canonical_json(Decimal("0.10")) == b"0.1"
    with pytest.raises(ValueError, match="NaN"):
        canonical_json(Decimal("NaN"))


@pytest.mark.parametrize(
    "number",
    [
        b"1e400",
        b"-1e309",
        b"1e999999999999999999999",
        b"179769313486231580793728971405303415079934132710037826936173778980444968292764750946"
        b"649017977587207096330286416692887910946555547851940402630657488671505820681908902000"
        b"708383676273854845817711531764475730270069855571366959622842914819860834936475292719"
        b"074168444365510704342711559699508093042880177904174497792.0",
    ],
)
def test_numbers_a_double_reads_as_infinity_are_refused(number: bytes) -> None:
    # The last is the midpoint between the largest double and 2**1024: float() rounds it up.
    assert float(number) in (float("inf"), float("-inf")) or b"999999999999" in number
    rejection = refused(body=b"[" + number + b"]")
    assert rejection.kind is ProblemKind.BODY_INVALID


def test_the_largest_double_is_accepted_exactly() -> None:
    largest = b"1.7976931348623157e308"
    # (Its digits are an integer the double is not: json.loads reads the double, unlike that
    # integer, and the canonical form has a zero fraction digit more to tell them apart.)
    assert canonical_body(JSON, largest)[1] == b"1.79769313486231570e+308"
    assert canonical_body(JSON, b"-" + largest)[1] == b"-1.79769313486231570e+308"


# Caps


def test_query_fields_are_capped() -> None:
    at_cap = b"&".join([b"a=1"] * 5)
    assert len(fingerprint(query_string=at_cap, max_fields=5)) == 32
    rejection = refused(query_string=at_cap + b"&b", max_fields=5)
    assert rejection.kind is ProblemKind.TOO_MANY_FIELDS
    assert "at most 5 fields" in rejection.detail
    # The finding's body: a megabyte of "a&a&...". Refused on a count, before any split.
    assert refused(query_string=b"a&" * (1 << 19)).kind is ProblemKind.TOO_MANY_FIELDS


def test_form_fields_are_capped() -> None:
    assert len(fingerprint(content_type=FORM, body=b"a&" * 4 + b"a", max_fields=5)) == 32
    rejection = refused(content_type=FORM, body=b"a&" * (1 << 19))
    assert rejection.kind is ProblemKind.TOO_MANY_FIELDS
    assert rejection.detail == "A form body may hold at most 1000 fields."


def test_multipart_parts_are_capped() -> None:
    content_type = b"multipart/form-data; boundary=Zq"
    part = b'--Zq\r\nContent-Disposition: form-data; name="f"\r\n\r\nv\r\n'
    assert len(fingerprint(content_type=content_type, body=part * 3 + b"--Zq--", max_fields=3))
    rejection = refused(content_type=content_type, body=part * 4 + b"--Zq--", max_fields=3)
    assert rejection.kind is ProblemKind.TOO_MANY_FIELDS


@pytest.mark.parametrize(
    ("body", "values"),
    [
        (b"[]", 1),
        (b"[1]", 2),
        (b'{"a":[1,2],"b":{}}', 5),
        (b'{"a":[[],{}],"b":"x,y,[z]"}', 5),
        (b'["a\\",b", "[{,}]"]', 3),
    ],
)
def test_json_values_are_counted_exactly(body: bytes, values: int) -> None:
    parse_json_strict(body, max_values=values)
    with pytest.raises(RequestRejected) as caught:
        parse_json_strict(body, max_values=values - 1)
    assert caught.value.kind is ProblemKind.TOO_MANY_FIELDS


def test_json_values_are_capped() -> None:
    assert canonical_body(JSON, b"[" + b"1," * 9_998 + b"1]")[0] == b"json:application/json"
    rejection = refused(body=b"[" + b"1," * 9_999 + b"1]")
    assert rejection.kind is ProblemKind.TOO_MANY_FIELDS
    assert "at most 10000 values" in rejection.detail
    assert (
        refused(body=b"[" + b"1," * 10 + b"1]", max_json_values=5).kind
        is ProblemKind.TOO_MANY_FIELDS
    )
    # Many short strings are refused on the count of quotes, before any per-string scan.
    strings = b"[" + b'"a,b",' * 30_000 + b'""]'
    assert refused(body=strings).kind is ProblemKind.TOO_MANY_FIELDS
    # Commas inside strings are not values.
    text = b'{"text":"' + b"a, " * 50_000 + b'"}'
    assert canonical_body(JSON, text)[1].startswith(b'{"text":"a, a, ')


def test_unbalanced_or_hollow_brackets_are_refused_without_a_loop() -> None:
    for body in (b"[" + b"[]" * 200_000 + b"]", b"]" * 300_000, b"[" * 300_000):
        assert refused(body=body, max_json_values=10**9).kind is ProblemKind.BODY_INVALID


def test_policy_caps_are_validated() -> None:
    assert Policy().max_fields == 1000
    assert Policy().max_json_values == 10_000
    for options in ({"max_fields": 0}, {"max_json_values": 0}, {"max_fields": -1}):
        with pytest.raises(ConfigurationError):
            Policy(**options)


def test_an_integer_past_the_interpreters_digit_limit_is_refused_saying_so() -> None:
    import sys

    limit = sys.get_int_max_str_digits()
    assert len(fingerprint(body=b"[" + b"9" * limit + b"]")) == 32  # the limit itself parses
    too_long = refused(body=b'{"amount": ' + b"9" * (limit + 1) + b"}")
    assert too_long.kind is ProblemKind.BODY_INVALID
    assert too_long.detail == f"A number in the request body has more than {limit} digits."
    assert refused(body=b'{"amount": 9').detail == "The request body is not valid JSON."
