"""Request fingerprints: SHA-256 over the operation, params, chosen headers and canonical body.

Deliberate JCS (RFC 8785) deviation: ints beyond ±2**53 are written as exact digits, not rounded."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from json.encoder import encode_basestring as _escape_str
from operator import itemgetter
from typing import Any
from urllib.parse import parse_qsl

from .errors import ProblemKind, RequestRejected

__all__ = [
    "FINGERPRINT_VERSION",
    "canonical_body",
    "canonical_json",
    "compute_fingerprint",
    "parse_json_strict",
]

FINGERPRINT_VERSION: bytes = b"idem-fp-1"

_U64 = struct.Struct(">Q").pack
# Clients draw a fresh random boundary per attempt; a retry must still match the original.
_MULTIPART_PLACEHOLDER = b"--idem-fp-boundary"
# Below 2**53 every integral double is exact and its shortest round-trip digits are its own.
_EXACT_INT_FLOAT = 2.0**53

_NOT_JSON = "The request body is not valid JSON."
_NOT_UTF8 = "The request body is not valid UTF-8."
_BOM = "The request body must not start with a byte order mark."
_DUPLICATE_KEY = "The request body has a duplicate JSON object key."
_NON_FINITE = "JSON numbers must be finite; NaN and Infinity are not allowed."
_OUT_OF_RANGE = "A JSON number is too large to be represented."
_TOO_DEEP = "The request body nests JSON objects and arrays too deeply."
_SURROGATE_TEXT = "The request body has a JSON string with an unpaired surrogate."
_BAD_CHARSET = "JSON request bodies must be encoded in UTF-8."
_FORM_NOT_UTF8 = "The form body is not valid UTF-8."


class _Invalid(ValueError):
    """Raised from the json hooks to carry a client-facing detail out of the decoder."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _reject_constant(_name: str) -> object:
    raise _Invalid(_NON_FINITE)


def _finite_float(text: str) -> float:
    value = float(text)
    # float() turns an overlong exponent such as 1e400 into inf, which JCS cannot write.
    if math.isinf(value):
        raise _Invalid(_OUT_OF_RANGE)
    return value


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Invalid(_DUPLICATE_KEY)
    return obj


# The parser json.loads would build for these hooks, built once instead of per request.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_pairs,
    parse_float=_finite_float,
    parse_constant=_reject_constant,
)

# Matches from any quote to its end, or to the end of the text when unterminated, so that
# scanning never fails and retries from a later quote (which would make it quadratic).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# Only \u escapes can yield surrogates: raw ones were already refused by the UTF-8 decoder.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _check_depth(text: str, max_depth: int) -> None:
    # Counting every bracket, even inside strings, bounds the depth from above and spares
    # the scan for the common shallow body.
    if text.count("[") + text.count("{") <= max_depth:
        return
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
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


def parse_json_strict(body: bytes, *, max_depth: int = 128) -> object:
    """Parse an I-JSON body; anything else raises RequestRejected(BODY_INVALID)."""
    if body[:3] == b"\xef\xbb\xbf":
        raise RequestRejected(ProblemKind.BODY_INVALID, _BOM)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestRejected(ProblemKind.BODY_INVALID, _NOT_UTF8) from None
    _check_depth(text, max_depth)
    try:
        value: object = _DECODER.decode(text)
    except _Invalid as exc:
        raise RequestRejected(ProblemKind.BODY_INVALID, exc.detail) from None
    except (ValueError, TypeError, RecursionError):
        # ValueError covers JSONDecodeError and ints past the interpreter's digit limit.
        raise RequestRejected(ProblemKind.BODY_INVALID, _NOT_JSON) from None
    if _SURROGATE_ESCAPE.search(text) is not None and _has_lone_surrogate(value):
        raise RequestRejected(ProblemKind.BODY_INVALID, _SURROGATE_TEXT)
    return value


def _format_float(value: float) -> bytes:
    """ECMAScript Number.prototype.toString, from the shortest round-trip digits of repr()."""
    if math.isnan(value) or math.isinf(value):
        raise ValueError("NaN and Infinity cannot be written as JSON")
    if -_EXACT_INT_FLOAT < value < _EXACT_INT_FLOAT and value.is_integer():
        # Also maps -0.0 to "0", as ECMAScript does.
        return b"%d" % int(value)
    text = repr(value)
    sign = ""
    if text[0] == "-":
        sign = "-"
        text = text[1:]
    mantissa, _, exponent = text.partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    # ECMAScript's n: the value is 0.<digits> * 10**n once leading zeros are gone.
    point = len(whole) + (int(exponent) if exponent else 0)
    significant = digits.lstrip("0")
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
        # Exact digits at any size: equal to JCS within ±2**53, the documented deviation beyond.
        out(b"%d" % value)  # type: ignore[str-format]
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
        out(b"%d" % value)
    elif isinstance(value, float):
        out(_format_float(float(value)))
    else:
        raise TypeError(f"cannot canonicalise a {kind.__name__} as JSON")


def canonical_json(value: object) -> bytes:
    """Serialise a parsed JSON value per RFC 8785 (with the big-int deviation above)."""
    chunks: list[bytes] = []
    _write(value, chunks.append)
    return b"".join(chunks)


_MEDIA_PARAM = re.compile(
    rb";[ \t]*([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*=[ \t]*(\"(?:[^\"\\]|\\.)*\"|[^;]*)",
    re.DOTALL,
)
_QUOTED_PAIR = re.compile(rb"\\(.)", re.DOTALL)


def _parse_media_type(content_type: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    essence, semicolon, _ = content_type.partition(b";")
    media_type = essence.strip(b" \t").lower()
    params: dict[bytes, bytes] = {}
    if semicolon:
        for match in _MEDIA_PARAM.finditer(content_type, len(essence)):
            raw = match.group(2)
            quoted = len(raw) > 1 and raw[:1] == b'"' and raw[-1:] == b'"'
            value = _QUOTED_PAIR.sub(rb"\1", raw[1:-1]) if quoted else raw.rstrip(b" \t")
            params.setdefault(match.group(1).lower(), value)
    return media_type, params


@lru_cache(maxsize=256)
def _pointer_tokens(pointer: str) -> tuple[str, ...]:
    # RFC 6901: "~1" must be decoded before "~0", or "~01" would wrongly become "/".
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/"))


def _remove_json_fields(value: object, exclude_fields: Sequence[str]) -> None:
    if not isinstance(value, dict):
        return
    for field in exclude_fields:
        if not field.startswith("/"):
            value.pop(field, None)
            continue
        *path, last = _pointer_tokens(field)
        target: object = value
        for token in path:
            target = target.get(token) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target.pop(last, None)


def _top_level_names(exclude_fields: Sequence[str]) -> set[str]:
    names: set[str] = set()
    for field in exclude_fields:
        if not field.startswith("/"):
            names.add(field)
        else:
            tokens = _pointer_tokens(field)
            if len(tokens) == 1:
                names.add(tokens[0])
    return names


def _canonical_form(body: bytes, exclude_fields: Sequence[str]) -> bytes:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestRejected(ProblemKind.BODY_INVALID, _FORM_NOT_UTF8) from None
    # surrogateescape keeps undecodable %XX bytes distinct instead of folding them into U+FFFD.
    pairs = parse_qsl(text, keep_blank_values=True, errors="surrogateescape")
    if exclude_fields:
        excluded = _top_level_names(exclude_fields)
        pairs = [pair for pair in pairs if pair[0] not in excluded]
    # A stable sort: the order of different names is noise, the order of repeats is data.
    pairs.sort(key=itemgetter(0))
    chunks = [_U64(len(pairs))]
    for name, field_value in pairs:
        for text_part in (name, field_value):
            encoded = text_part.encode("utf-8", "surrogateescape")
            chunks.append(_U64(len(encoded)))
            chunks.append(encoded)
    return b"".join(chunks)


def canonical_body(
    content_type: bytes | None, body: bytes, exclude_fields: Sequence[str] = ()
) -> tuple[bytes, bytes]:
    """Return (media tag, canonical bytes) for a request body."""
    if not body:
        return b"empty", b""
    if content_type is None:
        return b"raw:", body
    media_type, params = _parse_media_type(content_type)
    if media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json")
    ):
        charset = params.get(b"charset")
        if charset is not None and charset.lower() != b"utf-8":
            raise RequestRejected(ProblemKind.BODY_INVALID, _BAD_CHARSET)
        value = parse_json_strict(body)
        if exclude_fields:
            # parse_json_strict returned a fresh tree, so editing it in place is safe.
            _remove_json_fields(value, exclude_fields)
        return b"json", canonical_json(value)
    if media_type == b"application/x-www-form-urlencoded":
        return b"form", _canonical_form(body, exclude_fields)
    if media_type.startswith(b"multipart/"):
        boundary = params.get(b"boundary")
        if boundary:
            return b"multipart", body.replace(b"--" + boundary, _MULTIPART_PLACEHOLDER)
    return b"raw:" + media_type, body


def _put(update: Callable[[bytes], None], data: bytes) -> None:
    update(_U64(len(data)))
    update(data)


def compute_fingerprint(
    *,
    operation: str,
    path_params: Mapping[str, object],
    query_string: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    include_headers: Sequence[str],
    content_type: bytes | None,
    body: bytes,
    exclude_fields: Sequence[str] = (),
) -> bytes:
    """Return the 32-byte SHA-256 fingerprint of a request."""
    # First, so an invalid body is refused before any hashing work.
    media_tag, canonical = canonical_body(content_type, body, exclude_fields)

    digest = hashlib.sha256()
    update = digest.update
    # Every part is length-prefixed and every list is preceded by its count, so no two
    # different requests can produce the same byte stream.
    _put(update, FINGERPRINT_VERSION)
    _put(update, operation.encode("utf-8", "surrogatepass"))

    _put(update, _U64(len(path_params)))
    for name in sorted(path_params):
        _put(update, name.encode("utf-8", "surrogatepass"))
        _put(update, str(path_params[name]).encode("utf-8", "surrogatepass"))

    # latin-1 maps every byte and every %XX to one code point, so no input can fail to
    # decode and distinct bytes stay distinct.
    query = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, encoding="latin-1")
    query.sort(key=itemgetter(0))
    _put(update, _U64(len(query)))
    for name, query_value in query:
        _put(update, name.encode("latin-1"))
        _put(update, query_value.encode("latin-1"))

    _put(update, _U64(len(include_headers)))
    if include_headers:
        wanted = [header.lower().encode("latin-1", "replace") for header in include_headers]
        found: dict[bytes, list[bytes]] = {header_name: [] for header_name in wanted}
        for header_name, header_value in headers:
            values = found.get(header_name)
            if values is None:
                values = found.get(header_name.lower())
            if values is not None:
                values.append(header_value)
        for header_name in wanted:
            values = found[header_name]
            _put(update, header_name)
            # A count of zero is the "absent" marker; an empty value has a count of one.
            _put(update, _U64(len(values)))
            for header_value in values:
                _put(update, header_value)

    _put(update, media_tag)
    _put(update, canonical)
    return digest.digest()
