"""Equal fingerprints mean equal requests, to every reader a handler might use.

Each property draws pairs of requests built to collide where a canonicalisation could go wrong
(respelt numbers, permuted or re-escaped form pieces, swapped multipart boundaries) and checks:
when the fingerprints are equal, json.loads (with exact numbers, and as Starlette's
request.json() calls it: integers exact, other numbers doubles), parse_qsl (as Starlette reads a
query string, and byte-exact), a reader that also splits on ";" (python-multipart's form parser)
and the email package's multipart parser all read the two alike. A second property per kind
checks that the respellings the fingerprint promises to ignore do give equal fingerprints, so
the first is never vacuous."""

from __future__ import annotations

import email
import email.policy
import json
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qsl

from hypothesis import given, settings
from hypothesis import strategies as st

from idem_middleware.errors import RequestRejected
from idem_middleware.fingerprint import compute_fingerprint

PROPERTY = settings(database=None, max_examples=400, deadline=None)
JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"


def digest(content_type: bytes | None, body: bytes, query: bytes = b"") -> bytes | None:
    """The fingerprint, or None when the request is refused (it then shares nothing)."""
    try:
        return compute_fingerprint(
            operation="POST /x",
            path_params={},
            query_string=query,
            headers=[],
            include_headers=[],
            content_type=content_type,
            body=body,
        )
    except RequestRejected:
        return None


# Readers


def same_json(a: Any, b: Any) -> bool:
    """Equal as data: numbers by exact value, never a bool for a number, objects unordered."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, int | Decimal) and isinstance(b, int | Decimal):
        return Decimal(a) == Decimal(b)
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_json, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return False


def json_reading(body: bytes, *, exact: bool) -> tuple[bool, Any]:
    try:
        # Not exact: as request.json() reads it, a number with a fraction or an exponent a float.
        parse_float = Decimal if exact else (lambda text: Decimal(float(text)))
        return True, json.loads(body, parse_float=parse_float)
    except ValueError:
        return False, None


def same_json_reading(a: bytes, b: bytes) -> bool:
    for exact in (True, False):
        (ok_a, value_a), (ok_b, value_b) = (
            json_reading(a, exact=exact),
            json_reading(b, exact=exact),
        )
        if ok_a != ok_b or (ok_a and not same_json(value_a, value_b)):
            return False
    return True


def multidict(pairs: list[tuple[Any, Any]]) -> dict[Any, list[Any]]:
    grouped: dict[Any, list[Any]] = {}
    for name, value in pairs:
        grouped.setdefault(name, []).append(value)
    return grouped


def semicolon_reader(data: bytes) -> list[tuple[bytes, bytes]]:
    """python-multipart's QuerystringParser: the next "&", or failing that the next ";"."""
    fields, i = [], 0
    while i < len(data):
        end = data.find(b"&", i)
        if end == -1:
            end = data.find(b";", i)
        if end == -1:
            end = len(data)
        name, _, value = data[i:end].partition(b"=")
        fields.append((name, value))
        i = end + 1
    return fields


def form_readings(data: bytes) -> list[dict[Any, list[Any]]]:
    text = data.decode("latin-1")
    return [
        # Starlette's QueryParams: latin-1 text, then parse_qsl's UTF-8 with replacement.
        multidict(parse_qsl(text, keep_blank_values=True)),
        multidict(parse_qsl(text, keep_blank_values=True, encoding="latin-1")),
        multidict(semicolon_reader(data)),
    ]


def multipart_reading(content_type: bytes, body: bytes) -> Any:
    message = email.message_from_bytes(
        b"Content-Type: " + content_type + b"\r\n\r\n" + body, policy=email.policy.HTTP
    )
    if not message.is_multipart():
        return ("single", message.get_payload(decode=True))
    parts = message.get_payload()
    assert isinstance(parts, list)
    return [(tuple(part.items()), part.get_payload(decode=True)) for part in parts]


# JSON


# Pairs a double cannot tell apart, and respellings of one value.
ADVERSARIAL_PAIRS = [
    ("9007199254740993.0", "9007199254740992"),
    ("0.1", "0.1000000000000000055511151231257827"),
    ("1e-400", "0"),
    ("-0", "0"),
    ("1E21", "1000000000000000000000"),
    ("1.0", "10e-1"),
    ("333333333.33333329", "333333333.3333333"),
    ("123456789012345678901234", "123456789012345678901235"),
    # One value, but a double to request.json() in the first spelling, an exact int in the second.
    ("9007199254740993.0", "9007199254740993"),
    ("1e23", "100000000000000000000000"),
    ("-1.8446744073709551617e19", "-18446744073709551617"),
    ("9007199254740992.0", "9007199254740992"),
]


@st.composite
def number_spellings(draw: st.DrawFn) -> tuple[Decimal, str, str]:
    """An exact value and two spellings of it (or of a neighbour a double cannot tell apart)."""
    if draw(st.booleans()):
        first, second = draw(st.sampled_from(ADVERSARIAL_PAIRS))
        if draw(st.booleans()):
            first, second = second, first
        return Decimal(first), first, second
    coefficient = draw(st.integers(-(10**25), 10**25))
    exponent = draw(st.integers(-30, 30))

    def spell(extra_zeros: int, shift: int) -> str:
        return f"{coefficient * 10**extra_zeros}e{exponent - extra_zeros + shift}"

    second_shift = draw(st.sampled_from([0, 0, 0, 1]))
    first = spell(draw(st.integers(0, 3)), 0)
    second = spell(draw(st.integers(0, 3)), second_shift)
    return Decimal(first), first, second


@st.composite
def json_pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """Two renderings of one random document: members reordered, whitespace varied, each
    number respelt (sometimes as a different value)."""
    keys = st.sampled_from(["a", "b", "amount", "%61mount", "\u00e9", "\U0001f600"])

    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        # Named, not a lambda: Hypothesis reads `extend`'s source, and warns when it cannot.
        return st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3)

    shape = st.recursive(st.sampled_from(["num", "str", "true", "null"]), containers, max_leaves=8)
    tree = draw(shape)
    spellings: list[tuple[Decimal, str, str]] = []

    def render(node: Any, pick: int, numbers: list[int]) -> str:
        space = draw(st.sampled_from(["", " ", "\n"]))
        if node == "num":
            index = numbers[0]
            numbers[0] += 1
            if index == len(spellings):
                spellings.append(draw(number_spellings()))
            return space + spellings[index][1 + pick] + space
        if node == "str":
            return json.dumps(draw(st.sampled_from(["x", "&", "a,b", "%61"])))
        if node in ("true", "null"):
            return str(node)
        if isinstance(node, list):
            return "[" + ",".join(render(child, pick, numbers) for child in node) + "]"
        members = [json.dumps(k) + ":" + render(v, pick, numbers) for k, v in node.items()]
        return "{" + space + ",".join(draw(st.permutations(members))) + "}"

    first = render(tree, 0, [0])
    second = render(tree, 1, [0])
    return first.encode(), second.encode()


@settings(database=None, max_examples=150, deadline=None)
@given(json_pairs())
def test_json_fingerprints_are_equal_exactly_when_the_bodies_read_alike(
    pair: tuple[bytes, bytes],
) -> None:
    first, second = pair
    a, b = digest(JSON, first), digest(JSON, second)
    if a is not None and b is not None:
        assert (a == b) == same_json_reading(first, second), pair


# Forms and query strings

PIECE_TEXT = st.lists(
    st.sampled_from(["a", "b", "=", "%61", "%41", "A", "+", "%20", ";", '"', "[", "]", "x", "1"]),
    max_size=4,
).map("".join)


@st.composite
def piece_pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """Two "&"-joined texts whose pieces are a permutation of each other, one piece sometimes
    re-escaped: the collisions a sort or a decode could cause."""
    pieces = draw(st.lists(PIECE_TEXT, min_size=1, max_size=5))
    if draw(st.booleans()):
        # A JSON-looking frame: the first and last pieces open and close a string in an array.
        pieces = ['["' + pieces[0], *pieces[1:], '"]']
    other = list(draw(st.permutations(pieces)))
    if draw(st.booleans()):
        i = draw(st.integers(0, len(other) - 1))
        other[i] = other[i].replace("a", "%61", 1).replace(" ", "+")
    return "&".join(pieces).encode(), "&".join(other).encode()


@PROPERTY
@given(piece_pairs())
def test_equal_form_fingerprints_read_alike(pair: tuple[bytes, bytes]) -> None:
    first, second = pair
    a, b = digest(FORM, first), digest(FORM, second)
    if a is not None and a == b:
        assert form_readings(first) == form_readings(second), pair
        # request.json() ignores the content type.
        assert same_json_reading(first, second), pair


@PROPERTY
@given(piece_pairs())
def test_equal_query_fingerprints_read_alike(pair: tuple[bytes, bytes]) -> None:
    first, second = pair
    a, b = digest(None, b"", query=first), digest(None, b"", query=second)
    if a is not None and a == b:
        assert form_readings(first) == form_readings(second), pair


@PROPERTY
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "items[]", "x.y"]), st.sampled_from(["1", "2", ""])),
        min_size=1,
        max_size=6,
    ),
    st.randoms(use_true_random=False),
)
def test_reordering_plain_fields_keeps_the_fingerprint(
    fields: list[tuple[str, str]], random: Any
) -> None:
    body = "&".join(f"{n}={v}" for n, v in fields).encode()
    # Move fields of different names, keeping each name's values in order.
    names = list(dict.fromkeys(n for n, _ in fields))
    random.shuffle(names)
    moved = "&".join(f"{n}={v}" for name in names for n, v in fields if n == name).encode()
    assert digest(FORM, body) == digest(FORM, moved)
    assert digest(None, b"", query=body) == digest(None, b"", query=moved)


# Multipart

BOUNDARIES = [b"B1", b"idem-fp-boundary", b"Zx9", b"a b:c", b"----WebKitFormBoundaryQ7"]
VALUE_TEXT = st.lists(
    st.sampled_from([b"v", b"--", b"\r\n", b"B1", b"--idem-fp-boundary", b"Zx9", b"--Zx9"]),
    max_size=4,
).map(b"".join)


def render_multipart(boundary: bytes, values: list[bytes]) -> bytes:
    parts = b"".join(
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="f"\r\n\r\n' + v + b"\r\n"
        for v in values
    )
    return parts + b"--" + boundary + b"--\r\n"


@PROPERTY
@given(
    st.sampled_from(BOUNDARIES),
    st.sampled_from(BOUNDARIES),
    st.lists(VALUE_TEXT, min_size=1, max_size=3),
    st.lists(VALUE_TEXT, min_size=1, max_size=3),
    st.sampled_from(["same", "other", "replaced"]),
)
def test_equal_multipart_fingerprints_read_alike(
    boundary_a: bytes, boundary_b: bytes, values: list[bytes], others: list[bytes], how: str
) -> None:
    first = render_multipart(boundary_a, values)
    if how == "same":
        second = render_multipart(boundary_b, values)
    elif how == "other":
        second = render_multipart(boundary_b, others)
    else:
        # What version 1 did to the body, done by a client: the delimiters respelt.
        second = first.replace(b"--" + boundary_a, b"--" + boundary_b)
    type_a = b'multipart/form-data; boundary="' + boundary_a + b'"'
    type_b = b'multipart/form-data; boundary="' + boundary_b + b'"'
    a, b = digest(type_a, first), digest(type_b, second)
    if a is not None and a == b:
        assert multipart_reading(type_a, first) == multipart_reading(type_b, second)
        assert same_json_reading(first, second)
    delimiters = (b"--" + boundary_a, b"--" + boundary_b)
    if how == "same" and not any(d in b"".join(values) for d in delimiters):
        # No value holds either delimiter: only the boundary differs, and that is noise.
        assert a == b
