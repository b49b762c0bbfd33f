"""Unit tests for parsing the Idempotency-Key header."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idem_middleware.errors import ProblemKind, RequestRejected
from idem_middleware.keys import parse_idempotency_key

# No example database: the tests must not write files into the working tree.
PROPERTY = settings(database=None, max_examples=500, deadline=None)  # (a loaded CI machine)


def headers_with(value: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"example.com"), (b"idempotency-key", value), (b"accept", b"*/*")]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(b"abc", "abc", id="bare"),
        pytest.param(b'"abc"', "abc", id="quoted"),
        pytest.param(b" \tabc \t", "abc", id="bare-ows-stripped"),
        pytest.param(b'  "abc"\t', "abc", id="quoted-ows-stripped"),
        pytest.param(b'"a\\"b"', 'a"b', id="escaped-quote"),
        pytest.param(b'"a\\\\b"', "a\\b", id="escaped-backslash"),
        pytest.param(b'"\\\\\\""', '\\"', id="only-escapes"),
        pytest.param(b'" a b "', " a b ", id="quoted-inner-spaces-kept"),
        pytest.param(b"a,b", "a,b", id="comma-is-a-plain-char"),
        pytest.param(b'"a,b"', "a,b", id="quoted-comma"),
        pytest.param(b"!#$%&'*+-.^_`|~", "!#$%&'*+-.^_`|~", id="bare-punctuation"),
        pytest.param(b"a" * 255, "a" * 255, id="bare-255"),
        pytest.param(b'"' + b"a" * 255 + b'"', "a" * 255, id="quoted-255"),
        pytest.param(b'"' + b"a" * 254 + b'\\""', "a" * 254 + '"', id="quoted-255-after-unescape"),
        pytest.param(
            b"0d5e9e0c-8a9b-4c3e-9c55-2f4f8c0a7b11",
            "0d5e9e0c-8a9b-4c3e-9c55-2f4f8c0a7b11",
            id="uuid",
        ),
    ],
)
def test_valid_keys(raw: bytes, expected: str) -> None:
    assert parse_idempotency_key(headers_with(raw)) == expected


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"", id="empty-header"),
        pytest.param(b" \t ", id="only-whitespace"),
        pytest.param(b'""', id="empty-quoted"),
        pytest.param(b"a" * 256, id="bare-256"),
        pytest.param(b'"' + b"a" * 256 + b'"', id="quoted-256"),
        pytest.param(b'"' + b"a" * 254 + b'\\\\\\\\"', id="quoted-256-after-unescape"),
        pytest.param(b"a\x00b", id="bare-nul"),
        pytest.param(b"a\x1fb", id="bare-0x1f"),
        pytest.param(b"a\x7fb", id="bare-del"),
        pytest.param(b"a\tb", id="bare-tab-inside"),
        pytest.param(b"a b", id="bare-space-inside"),
        pytest.param(b'"a\x00b"', id="quoted-nul"),
        pytest.param(b'"a\x1fb"', id="quoted-0x1f"),
        pytest.param(b'"a\x7fb"', id="quoted-del"),
        pytest.param(b'"a\tb"', id="quoted-tab-inside"),
        pytest.param("caf\u00e9".encode(), id="bare-non-ascii"),
        pytest.param(b'"caf\xc3\xa9"', id="quoted-non-ascii"),
        pytest.param(b"\xff", id="bare-invalid-utf8"),
        pytest.param(b'"a\\nb"', id="bad-escape"),
        pytest.param(b'"a\\u0041"', id="unicode-escape"),
        pytest.param(b'"abc\\"', id="escaped-closing-quote"),
        pytest.param(b'"abc\\', id="lone-trailing-backslash"),
        pytest.param(b'"abc', id="unterminated"),
        pytest.param(b'"', id="single-quote-char"),
        pytest.param(b'"a"b"', id="unescaped-inner-quote"),
        pytest.param(b'"abc";x=1', id="parameters-after-quote"),
        pytest.param(b'"abc" x', id="junk-after-quote"),
        pytest.param(b'"abc", "def"', id="list-of-strings"),
        pytest.param(b'a"b', id="bare-with-quote"),
        pytest.param(b'abc"', id="bare-trailing-quote"),
    ],
)
def test_invalid_keys(raw: bytes) -> None:
    with pytest.raises(RequestRejected) as caught:
        parse_idempotency_key(headers_with(raw))
    assert caught.value.kind is ProblemKind.INVALID_KEY
    assert caught.value.detail


def test_absent_header_gives_none() -> None:
    assert parse_idempotency_key([(b"host", b"example.com")]) is None
    assert parse_idempotency_key([]) is None


def test_similar_header_names_are_not_the_key() -> None:
    headers = [(b"idempotency-key-x", b"abc"), (b"x-idempotency-key", b"def")]
    assert parse_idempotency_key(headers) is None


def test_header_name_is_matched_case_insensitively() -> None:
    assert parse_idempotency_key([(b"Idempotency-Key", b"abc")]) == "abc"


@pytest.mark.parametrize(
    ("first", "second"),
    [(b"abc", b"abc"), (b"abc", b"def"), (b"abc", b""), (b'"abc"', b"abc")],
)
def test_header_sent_twice_is_rejected(first: bytes, second: bytes) -> None:
    headers = [(b"idempotency-key", first), (b"accept", b"*/*"), (b"idempotency-key", second)]
    with pytest.raises(RequestRejected) as caught:
        parse_idempotency_key(headers)
    assert caught.value.kind is ProblemKind.INVALID_KEY


def test_quoted_and_bare_forms_give_the_same_key() -> None:
    assert parse_idempotency_key(headers_with(b'"abc-123"')) == parse_idempotency_key(
        headers_with(b"abc-123")
    )


@pytest.mark.parametrize(
    "raw",
    [b"SECRET-KEY\x00", b'"SECRET-KEY', b'"SECRET-KEY";a=1', b"SECRET-KEY" * 30],
)
def test_detail_does_not_echo_the_key(raw: bytes) -> None:
    with pytest.raises(RequestRejected) as caught:
        parse_idempotency_key(headers_with(raw))
    assert "SECRET" not in caught.value.detail


printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
key_like = st.one_of(
    st.binary(max_size=300),
    st.text(printable, max_size=300).map(str.encode),
    st.text(printable, max_size=300).map(lambda s: b'"' + s.encode() + b'"'),
    st.lists(st.sampled_from([b"a", b'"', b"\\", b" ", b"\t", b";", b"\x7f", b"\xc3"])).map(
        b"".join
    ),
)


@PROPERTY
@given(key_like)
def test_any_value_gives_a_valid_key_or_is_rejected(raw: bytes) -> None:
    key: str | None = None
    refusal: ProblemKind | None = None
    try:
        key = parse_idempotency_key(headers_with(raw))
    except RequestRejected as exc:
        refusal = exc.kind
    if key is None:
        assert refusal is ProblemKind.INVALID_KEY
    else:
        assert isinstance(key, str)
        assert 1 <= len(key) <= 255
        assert all(0x20 <= ord(char) <= 0x7E for char in key)


@PROPERTY
@given(st.text(printable, min_size=1, max_size=255))
def test_serialised_sf_string_round_trips(key: str) -> None:
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    assert parse_idempotency_key(headers_with(f'"{escaped}"'.encode())) == key


token_chars = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"')


@PROPERTY
@given(st.text(token_chars, min_size=1, max_size=255))
def test_bare_token_equals_its_quoted_form(token: str) -> None:
    quoted = '"' + token.replace("\\", "\\\\") + '"'
    assert parse_idempotency_key(headers_with(token.encode())) == token
    assert parse_idempotency_key(headers_with(quoted.encode())) == token


@PROPERTY
@given(st.text(token_chars, min_size=1, max_size=200), st.data())
def test_bare_token_with_a_quote_after_its_start_is_rejected(
    token: str, data: st.DataObject
) -> None:
    at = data.draw(st.integers(min_value=1, max_value=len(token)))
    with pytest.raises(RequestRejected):
        parse_idempotency_key(headers_with((token[:at] + '"' + token[at:]).encode()))


def test_a_bare_key_with_a_space_is_told_to_quote_it() -> None:
    """A space is printable ASCII, so "must be printable ASCII" alone sent the client looking
    for a wrong character; the detail says how such a key is sent, and that form is taken."""
    with pytest.raises(RequestRejected) as caught:
        parse_idempotency_key([(b"idempotency-key", b"order 42")])
    assert "quoted" in caught.value.detail
    assert parse_idempotency_key([(b"idempotency-key", b'"order 42"')]) == "order 42"
