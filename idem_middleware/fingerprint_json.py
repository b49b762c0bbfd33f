"""Strict JSON parsing and RFC 8785 (JCS) canonical JSON, with numbers kept exact.

Deliberate JCS deviation: a number is written as its exact decimal value, in the layout
ECMAScript uses for doubles. For every number that is the shortest spelling of a double (what
JSON serialisers emit) the output is exactly JCS; a number with more digits than a double holds
(`9007199254740993`, `0.1000000000000000055511151231257827`) keeps them, so two different values
never share a canonical form."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from json.encoder import encode_basestring as _escape_str
from typing import Any

from .errors import InvalidJson, ProblemKind, RequestRejected

__all__ = ["MAX_DEPTH", "canonical_json", "parse_json_strict"]

_NOT_JSON = "The request body is not valid JSON."
_NOT_UTF8 = "The request body is not valid UTF-8."


def _too_many_digits() -> str:
    limit = sys.get_int_max_str_digits()  # (the interpreter's: settable, 4300 by default)
    return f"A number in the request body has more than {limit} digits."


_BOM = "The request body must not start with a byte order mark."
_DUPLICATE_KEY = "The request body has a duplicate JSON object key."
_NON_FINITE = "JSON numbers must be finite; NaN and Infinity are not allowed."
_OUT_OF_RANGE = "A JSON number is too large to be represented."
_TOO_DEEP = "The request body nests JSON objects and arrays too deeply."
_SURROGATE_TEXT = "The request body has a JSON string with an unpaired surrogate."

# float() rounds a decimal to infinity from the midpoint between the largest double and 2**1024.
_DOUBLE_OVERFLOW = Decimal(2**1024 - 2**970)
# Integers below this are written as their digits by ECMAScript's layout (21 digits or fewer).
_PLAIN_INT = 10**21
# Below 2**53 every integral double is exact and its shortest round-trip digits are its own.
_EXACT_INT_FLOAT = 2.0**53


def _reject_constant(_name: str) -> object:
    raise InvalidJson(_NON_FINITE)


def _exact_number(text: str) -> Decimal:
    # Exact, never rounded to a double: a handler reading Decimals must see what was hashed.
    try:
        value = Decimal(text)
    except InvalidOperation:
        # An exponent beyond what Decimal holds (1e999999999999999999).
        raise InvalidJson(_OUT_OF_RANGE) from None
    # What a handler reading floats would turn into infinity is refused, as before.
    # copy_abs, unlike abs(), is exact: it never rounds to the context's precision.
    if value.copy_abs() >= _DOUBLE_OVERFLOW:
        raise InvalidJson(_OUT_OF_RANGE)
    return value


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise InvalidJson(_DUPLICATE_KEY)
    return obj


# The parser json.loads would build for these hooks, built once instead of per request.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_pairs,
    parse_float=_exact_number,
    parse_constant=_reject_constant,
)

# Matches from any quote to its end, or to the end of the text when unterminated, so that
# scanning never fails and retries from a later quote (which would make it quadratic).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_EMPTY_CONTAINER = re.compile(r"[\[{][ \t\n\r]*[\]}]")
# Only \u escapes can yield surrogates: raw ones were already refused by the UTF-8 decoder.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")

#: Default of parse_json_strict's max_depth, and the depth the fast path stays within.
MAX_DEPTH = 128


def _too_many_values(max_values: int) -> RequestRejected:
    return RequestRejected(
        ProblemKind.TOO_MANY_FIELDS,
        f"The JSON body may hold at most {max_values} values (members and elements).",
    )


def _check_shape(text: str, max_depth: int, max_values: int) -> None:
    """Refuse, before parsing, a body deeper than max_depth or with more than max_values values.

    Every step is a C-level count or regex pass, or a loop bounded by max_values: the cost of
    what follows (parsing, canonicalising) is then bounded by the caps, not by the body's size.
    """
    opens = text.count("[") + text.count("{")
    commas = text.count(",")
    # Counting brackets and commas even inside strings bounds both from above, and spares the
    # exact scan for the common body.
    if opens <= max_depth and 1 + commas + opens <= max_values:
        return
    # Each string is a value or a member's key, so there are at most twice as many strings as
    # values; this lower bound on strings refuses before the per-string scan can grow large.
    quotes = text.count('"') - text.count('\\"')
    if quotes > 4 * max_values + 2:
        raise _too_many_values(max_values)
    structure = _JSON_STRING.sub("", text)
    opens = structure.count("[") + structure.count("{")
    if structure.count("]") + structure.count("}") != opens:
        # Unbalanced outside strings: not JSON, and not worth a loop over every bracket.
        raise RequestRejected(ProblemKind.BODY_INVALID, _NOT_JSON)
    # A JSON text holds 1 + commas + non-empty containers values (root, members, elements);
    # the regex that finds the empty ones only runs when the commas alone do not decide.
    values = 1 + structure.count(",")
    if values + opens > max_values >= values:
        values += opens - len(_EMPTY_CONTAINER.findall(structure))
    else:
        values += opens
    if values > max_values:
        raise _too_many_values(max_values)
    if opens <= max_depth:
        return
    if opens > values:
        # Every container is a value, so this is not JSON ("[[][]]", say); refusing it here
        # keeps the loop below within twice max_values brackets.
        raise RequestRejected(ProblemKind.BODY_INVALID, _NOT_JSON)
    brackets = _NOT_BRACKET.sub("", structure)
    depth = 0
    for char in brackets:
        if char == "[" or char == "{":
            depth += 1
            if depth > max_depth:
                raise RequestRejected(ProblemKind.BODY_INVALID, _TOO_DEEP)
        else:
            depth -= 1


def _has_lone_surrogate(value: object) -> bool:
    # Iterative, so a structure as deep as max_depth allows cannot exhaust the stack.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, dict):
            for key, member in item.items():
                if _SURROGATE.search(key) is not None:
                    return True
                stack.append(member)
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json_strict(
    body: bytes, *, max_depth: int = MAX_DEPTH, max_values: int = 10_000
) -> object:
    """Parse an I-JSON body; anything else raises RequestRejected(BODY_INVALID).

    Integers come back as int, other numbers as exact Decimals. More than max_values values
    (the root, every member and every element) raises RequestRejected(TOO_MANY_FIELDS).
    """
    if body[:3] == b"\xef\xbb\xbf":
        raise RequestRejected(ProblemKind.BODY_INVALID, _BOM)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestRejected(ProblemKind.BODY_INVALID, _NOT_UTF8) from None
    _check_shape(text, max_depth, max_values)
    try:
        value: object = _DECODER.decode(text)
    except InvalidJson as exc:
        raise RequestRejected(ProblemKind.BODY_INVALID, exc.detail) from None
    except (ValueError, TypeError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and ints past the interpreter's digit limit.
        digits = type(exc) is ValueError and "digits" in str(exc)
        detail = _too_many_digits() if digits else _NOT_JSON
        raise RequestRejected(ProblemKind.BODY_INVALID, detail) from None
    if _SURROGATE_ESCAPE.search(text) is not None and _has_lone_surrogate(value):
        raise RequestRejected(ProblemKind.BODY_INVALID, _SURROGATE_TEXT)
    return value


def _layout(text: str) -> bytes:
    """ECMAScript Number::toString's layout of a finite decimal written as repr() or str() do.

    From the shortest round-trip digits of a float this is RFC 8785's number; from any other
    exact decimal it is that value's shortest exact digits in the same layout.
    """
    sign = ""
    if text[0] == "-":
        sign = "-"
        text = text[1:]
    mantissa, _, exponent = text.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    # ECMAScript's n: the value is 0.<digits> * 10**n once leading zeros are gone.
    point = len(whole) + (int(exponent) if exponent else 0)
    significant = digits.lstrip("0")
    if not significant:
        # Zero, of either sign and any exponent; ECMAScript writes -0 as "0".
        return b"0"
    point -= len(digits) - len(significant)
    digits = significant.rstrip("0")
    count = len(digits)
    if count <= point <= 21:
        out = digits + "0" * (point - count)
    elif 0 < point <= 21:
        out = digits[:point] + "." + digits[point:]
    elif -6 < point <= 0:
        out = "0." + "0" * -point + digits
    else:
        power = point - 1
        suffix = ("e+" if power >= 0 else "e-") + str(abs(power))
        out = digits + suffix if count == 1 else digits[0] + "." + digits[1:] + suffix
    return (sign + out).encode("ascii")


def _format_float(value: float) -> bytes:
    """RFC 8785's number: ECMAScript's layout of the shortest round-trip digits of repr().

    (Unmarked where _format_decimal marks those digits parsed from a body: a float is written as
    RFC 8785 writes it, and a body's floats, the fast path's, are all below 10**7.)"""
    if math.isnan(value) or math.isinf(value):
        raise ValueError("NaN and Infinity cannot be written as JSON")
    if -_EXACT_INT_FLOAT < value < _EXACT_INT_FLOAT and value.is_integer():
        # The common integral case, without the string work; also maps -0.0 to "0".
        return b"%d" % int(value)
    return _layout(repr(value))


def _format_int(value: int) -> bytes:
    # Exact at any size; within ±10**21 the layout is the plain digits.
    if -_PLAIN_INT < value < _PLAIN_INT:
        return b"%d" % value
    return _layout(str(value))


def _format_decimal(value: Decimal) -> bytes:
    if not value.is_finite():
        raise ValueError("NaN and Infinity cannot be written as JSON")
    # str() of a Decimal is exact (scientific notation, never rounded).
    text = _layout(str(value))
    # An integer no double holds, spelt with a fraction or an exponent: json.loads (and so
    # Starlette's request.json()) reads its spelling as an integer exactly but this one as the
    # nearest double, a different amount (9007199254740993 and 9007199254740993.0, 1e23).
    # (Below 10**15 every integer is a double: one method call decides.)
    if (
        value.adjusted() >= 15
        and value == value.to_integral_value()
        and Decimal(float(value)) != value
    ):
        return _not_a_double(text)
    return text


def _not_a_double(text: bytes) -> bytes:
    """`text`, an integer's layout, with one zero fraction digit more: a form no other number's
    layout has (it never ends a fraction with a zero, nor writes an integer with a point)."""
    mantissa, e, exponent = text.partition(b"e")
    return mantissa + (b"0" if b"." in mantissa else b".0") + e + exponent


def _dump_str(value: str) -> bytes:
    try:
        # The stdlib escaper produces JCS's exact output (only controls, `"` and `\`, with
        # lower-case \u00xx) and, unlike orjson.dumps, stays fast when thousands of results
        # are alive at once; the tests pin it to orjson's output.
        return _escape_str(value).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("JSON strings must not contain unpaired surrogates") from None


def _utf16_order(key: str) -> bytes:
    # Big-endian UTF-16 bytes compare exactly as the code units RFC 8785 sorts by.
    return key.encode("utf-16-be", "surrogatepass")


def _write(value: object, out: Callable[[bytes], object]) -> None:
    # Exact type tests first: they are what the parser produces and the cheapest to check.
    kind = type(value)
    if kind is str:
        out(_dump_str(value))  # type: ignore[arg-type]
    elif kind is dict:
        members: dict[Any, object] = value  # type: ignore[assignment]
        try:
            # For ASCII keys code-point order is UTF-16 order, and plain sorting is much cheaper.
            if all(map(str.isascii, members)):
                keys = sorted(members)
            else:
                keys = sorted(members, key=_utf16_order)
        except (TypeError, AttributeError):
            # str.isascii and str.encode both refuse a key that is not a str.
            raise TypeError("JSON object keys must be str") from None
        separator = b""
        out(b"{")
        for key in keys:
            out(separator + _dump_str(key) + b":")
            separator = b","
            _write(members[key], out)
        out(b"}")
    elif kind is list:
        elements: list[object] = value  # type: ignore[assignment]
        separator = b""
        out(b"[")
        for element in elements:
            if separator:
                out(separator)
            separator = b","
            _write(element, out)
        out(b"]")
    elif kind is int:
        out(_format_int(value))  # type: ignore[arg-type]
    elif kind is Decimal:
        out(_format_decimal(value))  # type: ignore[arg-type]
    elif kind is float:
        out(_format_float(value))  # type: ignore[arg-type]
    elif value is None:
        out(b"null")
    elif value is True:
        out(b"true")
    elif value is False:
        out(b"false")
    # Subclasses (StrEnum, IntEnum, OrderedDict, ...) are written as their base type.
    elif isinstance(value, str):
        out(_dump_str(value))
    elif isinstance(value, dict):
        _write(dict(value), out)
    elif isinstance(value, list):
        _write(list(value), out)
    elif isinstance(value, int):
        # bool cannot be subclassed, so True and False were handled above.
        out(_format_int(int(value)))
    elif isinstance(value, float):
        out(_format_float(float(value)))
    else:
        raise TypeError(f"cannot canonicalise a {kind.__name__} as JSON")


def canonical_json(value: object) -> bytes:
    """Serialise a parsed JSON value per RFC 8785, numbers exact (see the module docstring)."""
    chunks: list[bytes] = []
    _write(value, chunks.append)
    return b"".join(chunks)
