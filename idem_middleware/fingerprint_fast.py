"""A fast path for canonical JSON: orjson, where its result is provably the reference's.

The reference (fingerprint_json: the json module with exact numbers and strict checks, then
RFC 8785 written in Python) costs tens of microseconds for a small body. orjson parses and
writes the same body in a few, but differs where it matters: it keeps one of duplicate members,
reads numbers as doubles, sorts keys by code point rather than UTF-16 code unit, and nests
deeper. canonical_json_fast answers only where none of that can show, and leaves everything
else (every refusal included) to the reference; docs/fingerprint.md gives the argument."""

from __future__ import annotations

import re
from typing import Any

import orjson

from .fingerprint_json import MAX_DEPTH

__all__ = ["canonical_json_fast", "canonical_json_sorted"]

# The fast path's guards, on the raw bytes. A number orjson reads as a double (one with a
# fraction, an exponent or 19 digits or more; a root number is checked after parsing) unless it
# is a plain decimal that orjson writes as canonical_json does: at most 15 significant digits
# (so they are the double's shortest round-trip digits), and a value from 0.001 to below 10**7
# (where both write plain digits), or zero. Trailing zeros are fine (`12.50`, `10.00`: a
# payment's amounts): the double is the same, and one with no fraction left is written as the
# integer it is (`_integral`). One search, in C: the lookahead lets a plain decimal through only
# when it is the whole number (a character not in a number follows).
_PLAIN_DECIMAL = (
    rb"-?(?:0\.0{0,2}[1-9](?:[0-9]{0,11}[1-9])?|[1-9][0-9]{0,6}\.(?:[0-9]{0,7}[1-9])?|0\.)0*"
)
_DOUBTFUL_NUMBER = re.compile(
    # ((?=[-0-9]): a value that is no number, most of them, fails before the plain-decimal test)
    rb"[:,\[][ \t\n\r]*(?=[-0-9])(?!" + _PLAIN_DECIMAL + rb"[^-+.eE0-9])-?(?:[0-9]+[.eE]|[0-9]{19})"
)
#: Digits to "0", `e` and `E` to "." (every other byte stays itself): what a number needs for
#: `_DOUBTFUL_NUMBER` to match it shows as "0." or nineteen "0"s.
_NUMBER_SHAPE = bytes.maketrans(b"0123456789eE", b"0000000000..")
_NINETEEN_DIGITS = b"0" * 19
# A character beyond U+FFFF, and one in U+E000-U+FFFF: orjson sorts keys by code point, JCS by
# UTF-16 code unit, and the two orders differ only between such characters. Written raw, the
# first starts with a byte F0-F4 and the second with EE or EF: found by deleting every other
# byte (`translate`, in C; a regex's search for a class of bytes took 4-5 µs for a 478-byte
# body in a loop, and its engine runs cache-cold in place). Escaped, each is a `\u` and a
# high surrogate, or a `\u` and E or F: regexes, run only when the body has a `\u`. (Bytes
# F5-FF count too: they are no UTF-8, and orjson refuses the body either way.)
_ALL_BELOW_F0 = bytes(range(0xF0))
_ALL_BUT_EE_EF = bytes(set(range(256)) - {0xEE, 0xEF})
_ASTRAL_ESCAPE = re.compile(rb"\\u[dD][89abAB]")
_HIGH_BMP_ESCAPE = re.compile(rb"\\u[eEfF]")
_SORT_KEYS = orjson.OPT_SORT_KEYS
# Past this size the fast path is not tried: its regex scans (a few ns a byte) would only add to
# the reference's cost whenever it falls back.
_FAST_MAX_BYTES = 64 * 1024


def canonical_json_fast(body: bytes, max_values: int) -> tuple[object, bytes] | None:
    """(the parsed value, canonical_json's bytes) for `body`, computed by orjson, when its result
    is provably parse_json_strict's and canonical_json's; None otherwise, and for every body
    they refuse. The value is parse_json_strict's but for floats where it has Decimals (integers
    where those hold one), and canonical_json_sorted writes it (or a part of it) as
    canonical_json writes theirs.

    Taken only for a body the reference accepts without its slow checks (within the depth and
    value caps by a plain count), with no number but integers orjson reads exactly and plain
    decimals it writes exactly, and no key order in doubt. Duplicate members, which orjson keeps
    one of silently, are ruled out by counting colons: without them the canonical text has
    exactly the body's colons (one per member, and those inside strings) plus the ones the body
    escapes as \\u003a.
    """
    size = len(body)
    if size > _FAST_MAX_BYTES:
        return None
    # Each byte is at most one value or one bracket, so a short body needs no count.
    if size > MAX_DEPTH or size >= max_values:
        opens = body.count(b"[") + body.count(b"{")
        if opens > MAX_DEPTH or 1 + body.count(b",") + opens > max_values:
            return None
    # The search, only for a body where it can match: one with a digit just before a `.`, `e`
    # or `E`, or 19 digits in a row (a translation and two finds, in C, cost far less).
    shape = body.translate(_NUMBER_SHAPE)
    has_point = shape.find(b"0.") >= 0
    if (has_point or shape.find(_NINETEEN_DIGITS) >= 0) and (
        _DOUBTFUL_NUMBER.search(body) is not None
    ):
        return None
    escaped_colons = 0
    # (`find`, not `in`: bytes' `in` tries the operand as an integer first, and formats the
    # TypeError it then discards.)
    ascii_only = body.isascii()
    if not ascii_only or body.find(b"\\u") >= 0:
        escaped = ascii_only or body.find(b"\\u") >= 0
        if (
            (not ascii_only and body.translate(None, _ALL_BELOW_F0))
            or (escaped and _ASTRAL_ESCAPE.search(body) is not None)
        ) and (
            (not ascii_only and body.translate(None, _ALL_BUT_EE_EF))
            or (escaped and _HIGH_BMP_ESCAPE.search(body) is not None)
        ):
            return None
        if escaped:
            escaped_colons = body.count(b"\\u003a") + body.count(b"\\u003A")
    try:
        # orjson refuses all parse_json_strict refuses within these guards (a byte order mark,
        # invalid UTF-8, unpaired surrogates, NaN, ...); the tests compare the two on any bytes.
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(value) is float:
        return None
    canonical = orjson.dumps(value, option=_SORT_KEYS)
    # orjson writes a float that holds an integer as `10.0` (and only such a float so): when
    # its text may hold one (a string may too), the floats are made integers and written again.
    if (
        has_point
        and canonical.find(b".0") >= 0
        and (
            canonical.find(b".0,") >= 0
            or canonical.find(b".0}") >= 0
            or canonical.find(b".0]") >= 0
        )
    ):
        value = _integral(value)
        canonical = orjson.dumps(value, option=_SORT_KEYS)
    # A dropped duplicate makes the canonical count smaller. "\\\\u003a" (an escaped backslash,
    # then text) is counted as an escaped colon but is none: it only sends the body to the
    # reference path.
    if canonical.count(b":") != body.count(b":") + escaped_colons:
        return None
    return value, canonical


def _integral(value: Any) -> Any:
    """`value` with each float that holds an integer (`10.00`, read as 10.0) made that integer,
    as canonical_json writes it (orjson would write `10.0`); in place: the tree is fresh."""
    kind = type(value)
    if kind is float:
        return int(value) if value.is_integer() else value
    if kind is dict:
        for key, item in value.items():
            if type(item) in _CONTAINERS_AND_FLOAT:
                value[key] = _integral(item)
    elif kind is list:
        for index, item in enumerate(value):
            if type(item) in _CONTAINERS_AND_FLOAT:
                value[index] = _integral(item)
    return value


_CONTAINERS_AND_FLOAT = (dict, list, float)


def canonical_json_sorted(value: object) -> bytes:
    """canonical_json's bytes for what canonical_json_fast returned, or a part of it."""
    return orjson.dumps(value, option=_SORT_KEYS)
