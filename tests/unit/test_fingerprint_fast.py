"""The orjson fast path for JSON bodies gives exactly the reference path's result, or none.

canonical_json_fast answers only when its result is provably the reference's (parse_json_strict,
then canonical_json); canonical_body falls back to the reference for everything else, every
refusal included. These properties compare canonical_body with the fast path against
canonical_body with it switched off, on JSON texts written to hit each of the fast path's guards
(inexact numbers, big integers, astral and U+E000-U+FFFF keys, escapes, duplicate members,
nesting, the value cap) and on arbitrary and mutated bytes: the canonical bytes and every
refusal's kind and detail must be the same."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idem_middleware import fingerprint as fingerprint_module
from idem_middleware.errors import ProblemKind, RequestRejected
from idem_middleware.fingerprint import (
    canonical_body,
    canonical_json,
    compute_fingerprint,
    parse_json_strict,
)
from idem_middleware.fingerprint_fast import canonical_json_fast

PROPERTY = settings(database=None, max_examples=800, deadline=None)
JSON = b"application/json"

Outcome = tuple[bytes, bytes] | tuple[ProblemKind, str]


def outcome(body: bytes, **options: Any) -> Outcome:
    try:
        return canonical_body(JSON, body, **options)
    except RequestRejected as exc:
        return exc.kind, exc.detail


def _no_fast_path(body: bytes, max_values: int) -> None:
    return None


@contextmanager
def reference_path() -> Iterator[None]:
    with mock.patch.object(fingerprint_module, "canonical_json_fast", _no_fast_path):
        yield


def assert_same_as_reference(body: bytes, **options: Any) -> None:
    fast = outcome(body, **options)
    with reference_path():
        reference = outcome(body, **options)
    assert fast == reference
    # And when the fast path answers, its value is the reference parser's, type for type.
    answer = canonical_json_fast(body, options.get("max_json_values", 10_000))
    if answer is not None:
        value = parse_json_strict(body, max_values=options.get("max_json_values", 10_000))
        assert same_tree(answer[0], value)
        assert answer[1] == canonical_json(value)


def same_tree(a: object, b: object) -> bool:
    """The fast path's value is the reference parser's, but for floats where it has Decimals, and
    integers where it has Decimals that hold one (`10.00`)."""
    if type(a) is float and type(b) is Decimal:
        return Decimal(repr(a)) == b
    if type(a) is int and type(b) is Decimal:
        return Decimal(a) == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_tree, a, b))
    return a == b


# JSON texts, written by hand so that they can hold what a serialiser never writes.

# Characters that matter to the guards: astral and U+E000-U+FFFF (their key order differs
# between code points and UTF-16), colons (the duplicate check counts them), controls, escapes.
SPECIAL = ["\U0001f600", "\U00010000", "\U0010ffff", "\ue000", "\uffff", "\ufeff", "\u2028"]
SPECIAL += ["é", ":", "\\", '"', "/", "\x00", "\x1f", "\x7f", "a", "b", "A"]
# Written into the JSON text as they stand: an escaped colon, and an escaped backslash before
# text that reads like one.
SPECIAL += ["\\u003a", "\\u003A", "\\\\u003a"]
characters = st.sampled_from(SPECIAL) | st.characters()
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r"}
SHORT_ESCAPES |= {"\t": "\\t", "/": "\\/"}


def u_escape(code: int, upper: bool) -> str:
    text = f"\\u{code:04x}"
    return text.upper().replace("\\U", "\\u") if upper else text


@st.composite
def json_string(draw: st.DrawFn, max_size: int = 6) -> str:
    out = ['"']
    for char in draw(st.lists(characters, max_size=max_size)):
        how = draw(st.integers(0, 3))
        forced = char in '"\\' or (len(char) == 1 and ord(char) < 0x20)
        if len(char) > 1 or (how == 0 and not forced):
            out.append(char)  # a multi-character piece is text as it stands ("\\u003a")
        elif how == 1 and char in SHORT_ESCAPES:
            out.append(SHORT_ESCAPES[char])
        elif ord(char) > 0xFFFF:
            high, low = divmod(ord(char) - 0x10000, 0x400)
            upper = draw(st.booleans())
            out.append(u_escape(0xD800 + high, upper) + u_escape(0xDC00 + low, upper))
        else:
            out.append(u_escape(ord(char), draw(st.booleans())))
    out.append('"')
    return "".join(out)


# Keys from a small set, so that duplicates and the astral/U+E000 order come up often.
KEYS = ["a", "b", "A", "\U0001f600", "\ue000", "\uffff", "é", ":", "a:b", ""]
keys = st.sampled_from(KEYS).map(lambda key: '"' + key + '"') | json_string(max_size=3)


def key_spelling(name: str) -> st.SearchStrategy[str]:
    """`name` as a JSON string, as it stands or with every character \\u-escaped."""
    escaped = "".join(
        u_escape(ord(char), False)
        if ord(char) <= 0xFFFF
        else u_escape(0xD800 + (ord(char) - 0x10000) // 0x400, False)
        + u_escape(0xDC00 + (ord(char) - 0x10000) % 0x400, False)
        for char in name
    )
    return st.sampled_from(['"' + name + '"', '"' + escaped + '"'])


def plain_decimals(count: int, low: int = -9, high: int = 5) -> st.SearchStrategy[str]:
    """Decimals of `count` significant digits, from 10**(low - 1) to below 10**high."""
    return st.builds(
        lambda digits, scale, sign: sign + f"{Decimal(digits).scaleb(-scale):f}",
        st.integers(10 ** (count - 1), 10**count - 1),
        st.integers(count - high, count - low),
        st.sampled_from(["", "-"]),
    )


numbers = st.one_of(
    st.integers(min_value=-1000, max_value=1000).map(str),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(
        [
            *["18446744073709551615", "18446744073709551616", "-9223372036854775808"],
            *["-9223372036854775809", "9007199254740993", "-0", "1E400", "1e-400"],
            *["0.1000000000000000055511151231257827", "1.0", "1e21", "333333333.33333329"],
        ]
    ),
    st.from_regex(r"-?(0|[1-9][0-9]{0,22})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?", fullmatch=True),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    # Plain decimals, in and just outside what the fast path writes itself (up to 17 digits).
    st.integers(1, 17).flatmap(plain_decimals),
)
scalars = numbers | json_string() | st.sampled_from(["true", "false", "null"])
space = st.sampled_from(["", "", " ", "\n", "\t", "\r\n  "])


def _containers(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    # A named function: Hypothesis reads extend's source to check that it recurses.
    arrays = st.tuples(st.lists(children, max_size=5), space).map(
        lambda parts: "[" + parts[1] + ",".join(parts[0]) + "]"
    )
    members = st.lists(st.tuples(keys, space, children), max_size=5)
    # Distinct keys too, so that an object whose order is in doubt is often otherwise plain.
    distinct = st.lists(st.sampled_from(KEYS), unique=True, max_size=5).flatmap(
        lambda names: st.tuples(*(st.tuples(key_spelling(name), space, children) for name in names))
    )
    objects = (members | distinct).map(
        lambda items: "{" + ",".join(key + gap + ":" + value for key, gap, value in items) + "}"
    )
    return arrays | objects


documents = st.recursive(scalars, _containers, max_leaves=25)


@st.composite
def nested(draw: st.DrawFn) -> str:
    """A document inside 120 to 135 arrays or objects: around the depth cap."""
    depth = draw(st.integers(120, 135))
    inner = draw(documents)
    if draw(st.booleans()):
        return "[" * depth + inner + "]" * depth
    return '{"k":' * depth + inner + "}" * depth


texts = st.one_of(documents, documents, nested())
bodies = st.tuples(space, texts, space).map(lambda parts: "".join(parts))
encoded = bodies.map(lambda text: text.encode("utf-8", "surrogatepass"))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A JSON text with bytes inserted, replaced or cut off."""
    body = draw(encoded)
    at = draw(st.integers(0, len(body)))
    junk = draw(
        st.sampled_from([b"\xef\xbb\xbf", b"\xed\xa0\x80", b"\xff", b"\xc0\x80", b",", b":"])
        | st.binary(min_size=1, max_size=3)
    )
    how = draw(st.integers(0, 2))
    if how == 0:
        return body[:at] + junk + body[at:]
    if how == 1:
        return body[:at] + junk + body[at + len(junk) :]
    return body[:at]


caps = st.sampled_from([10_000, 10_000, 3, 8, 40])


@PROPERTY
@given(encoded, caps)
def test_json_documents_canonicalise_as_the_reference_does(body: bytes, cap: int) -> None:
    assert_same_as_reference(body, max_json_values=cap)


@PROPERTY
@given(st.one_of(mutated(), st.binary(min_size=1, max_size=60)), caps)
def test_any_bytes_are_refused_or_canonicalised_as_the_reference_does(
    body: bytes, cap: int
) -> None:
    assert_same_as_reference(body, max_json_values=cap)


@PROPERTY
@given(numbers, space)
def test_numbers_canonicalise_as_the_reference_does(number: str, gap: str) -> None:
    assert_same_as_reference(f'{{"n":[{gap}{number}],"m":{number}}}'.encode())


@settings(database=None, max_examples=2000, deadline=None)
@given(st.integers(14, 17).flatmap(lambda count: plain_decimals(count, -3, 8)))
def test_decimals_with_a_doubles_digits_canonicalise_as_the_reference_does(number: str) -> None:
    # Around 16 significant digits orjson's shortest digits begin to differ from the token's.
    assert_same_as_reference(b"[" + number.encode() + b"]")


pointers = st.sampled_from(["a", "/a", "/b/a", "/\U0001f600", "/\ue000", "/0", ":", "/a:b"])


@settings(database=None, max_examples=500, deadline=None)
@given(encoded, st.lists(pointers, max_size=3), st.lists(pointers, max_size=3))
def test_excluded_and_included_fields_apply_as_on_the_reference_path(
    body: bytes, exclude: list[str], include: list[str]
) -> None:
    assert_same_as_reference(body, exclude_fields=exclude, include_fields=include)


# The guards, each on its own: what the fast path answers and what it leaves to the reference.


@pytest.mark.parametrize(
    "body",
    [
        b'{"amount": 5}',
        b'{"amount": 1250, "to": {"iban": "DE89370400440532013000"}, "lines": [1, 2, 3]}',
        b'[true, false, null, -0, -999999999999999999, "a\\"b\\\\c\\n", "\\u00e9"]',
        b'{"time": "10:30", "url": "https://example.com/a:b", "e": "\\u003a"}',
        b'{"price": 4.5, "rate": 0.001, "lines": [3.25, -9999999.99999999, 0.00123456789012]}',
        # Trailing zeros, and floats that hold an integer (orjson would write 1.0, the reference 1)
        b'{"a": 1.0, "b": 1.50, "c": [10.00, -0.0, 0.000, 0.0010], "d": {"e": 9999999.00}}',
        b'{"amount": 110.00, "lines": [{"price": 10.00, "tax": 1.50}], "note": "x.0, y.0]"}',
        '{"caf\u00e9": "\U0001f600", "\U0001f600": 1}'.encode(),
        '{"\ue000": "\uff01", "\uffff": 1}'.encode(),
        '{"\u20ac": "\U0001f600", "\u00e9": "\\u00e9", "\\ud83d\\ude00": 1}'.encode(),
        '{"m\u00fcller": "\\ue000", "\u00df": ":"}'.encode(),
        b"5",
    ],
)
def test_the_fast_path_answers_for_plain_bodies(body: bytes) -> None:
    answer = canonical_json_fast(body, 10_000)
    assert answer is not None
    assert answer[1] == canonical_json(parse_json_strict(body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": 1, "a": 2}',  # a duplicate member
        b'{"a": ":", "a": 2}',  # ... whose colon hides it from a plain count
        b'{"a": "\\u003a", "a": ":"}',  # ... and one escaped
        b'{"a": "\\\\u003a"}',  # an escaped backslash: counted as an escaped colon, is none
        b'{"a": 1e5}',
        b'{"a": [-1E5]}',
        b'{"a": 0.0001}',  # below 0.001
        b'{"a": 10000000.5}',  # 10**7 or more
        b'{"a": 0.1000000000000000055511151231257827}',  # more digits than a double holds
        b'{"a": 1234567.123456789}',  # 16 significant digits
        b"1.5",
        b'{"a": 1234567890123456789}',  # 19 digits: orjson may read a double
        b'{"\xf0\x9f\x98\x80": 1, "\xee\x80\x80": 2}',  # astral and U+E000 keys
        b'{"\\ud83d\\ude00": 1, "\\ue000": 2}',
        b'{"\xf0\x9f\x98\x80": 1, "\\ue000": 2}',  # one raw, the other escaped
        b'{"\\ud83d\\ude00": 1, "\xef\xbf\xbf": 2, "\xc3\xa9": 3}',
        '{"\U0010ffff": 1, "\uffff": 2}'.encode(),
        b"[" * 129 + b"]" * 129,  # past the depth cap by a plain count
        b"\xef\xbb\xbf{}",
        b'{"a": NaN}',
        b'"\\ud800"',
        b'{"a": "\xed\xa0\x80"}',
    ],
)
def test_the_fast_path_leaves_doubtful_bodies_to_the_reference(body: bytes) -> None:
    assert canonical_json_fast(body, 10_000) is None
    assert_same_as_reference(body)


def test_the_value_cap_is_left_to_the_reference() -> None:
    body = b"[" + b",".join([b"1"] * 200) + b"]"
    assert canonical_json_fast(body, 200) is None
    assert canonical_json_fast(body, 201) is not None
    assert_same_as_reference(body, max_json_values=200)


def test_large_bodies_are_left_to_the_reference() -> None:
    within = b"[" + b"1," * (32 * 1024 - 2) + b"1]"  # 65,535 bytes
    assert canonical_json_fast(within, 10**6) is not None
    beyond = within[:-1] + b",1]"
    assert canonical_json_fast(beyond, 10**6) is None
    assert_same_as_reference(beyond, max_json_values=10**6)


def test_exact_numbers_keep_their_digits() -> None:
    for body, canonical in [
        (b"[9007199254740993]", b"[9007199254740993]"),
        (b"[0.1000000000000000055511151231257827]", b"[0.1000000000000000055511151231257827]"),
        (b"[18446744073709551616]", b"[18446744073709551616]"),
    ]:
        assert canonical_body(JSON, body) == (b"json:application/json", canonical)
    assert parse_json_strict(b"0.10") == Decimal("0.10")


# The digest: SHA-256 over the framed layout, whatever the stream's length.


@pytest.mark.parametrize("size", [0, 1900, 1990, 2000, 2100, 70_000])
def test_streams_short_and_long_hash_the_layout(size: int) -> None:
    body = b'{"p":"' + b"x" * size + b'"}'

    def part(data: bytes) -> bytes:
        return struct.pack(">Q", len(data)) + data

    stream = b"".join(
        [
            part(b"idem-fp-2"),
            part(b"POST /x"),
            part(struct.pack(">Q", 0)),
            part(b"raw"),  # the empty query string, as canonical_pairs writes it
            part(struct.pack(">Q", 0)),
            part(b"json:application/json"),
            part(body.replace(b" ", b"")),
        ]
    )
    digest = compute_fingerprint(
        operation="POST /x",
        path_params={},
        query_string=b"",
        headers=[],
        include_headers=[],
        content_type=JSON,
        body=body,
    )
    assert digest == hashlib.sha256(stream).digest()
