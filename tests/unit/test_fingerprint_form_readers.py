"""The form fingerprints against the reader a Starlette or FastAPI handler really uses: Starlette's
`request.form()` on python-multipart. Two requests whose fingerprints are equal must read alike
to it (docs/fingerprint.md, "What the fingerprint guarantees"): every field, file name, part
header and file content, or the same refusal. tests/unit/test_fingerprint_injective.py checks
the same promise against the standard library's readers; these pairs are built to hit what
python-multipart does of its own (a preamble it skips after a line end, a delimiter it takes
without a line end before it, transport padding, a body that ends before its closing delimiter).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from idem_middleware.errors import RequestRejected
from idem_middleware.fingerprint import compute_fingerprint

pytest.importorskip("python_multipart")

PROPERTY = settings(max_examples=1000, deadline=None)
FORM = b"application/x-www-form-urlencoded"


@pytest.fixture(autouse=True)
def _quiet_parser() -> Any:
    """python-multipart logs a warning for every malformed body it refuses."""
    logger = logging.getLogger("python_multipart")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def digest(content_type: bytes, body: bytes) -> bytes | None:
    try:
        return compute_fingerprint(
            operation="POST /f",
            path_params={},
            query_string=b"",
            headers=[],
            include_headers=(),
            content_type=content_type,
            body=body,
        )
    except RequestRejected:
        return None


async def _read(content_type: bytes, body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/f", "query_string": b""}
    request = Request({**scope, "headers": [(b"content-type", content_type)]}, receive)
    try:
        async with request.form() as form:
            fields: dict[str, list[Any]] = {}
            for name, value in form.multi_items():
                if not isinstance(value, str):
                    headers = sorted(value.headers.items())
                    value = (value.filename, value.content_type, headers, await value.read())
                fields.setdefault(name, []).append(value)
            return fields
    except Exception as exc:  # (the handler's 400: any refusal reads alike)
        return ("refused", type(exc).__name__)


def reading(content_type: bytes, body: bytes) -> Any:
    """The fields (by name, repeats in order) a handler's `request.form()` gets, or its refusal."""
    return asyncio.run(_read(content_type, body))


# Multipart: one list of pieces, rendered under two boundaries (None is a delimiter).

BOUNDARIES = [b"X", b"Y", b"XY", b"a b", b"X-", b"----WebKitFormBoundaryQ7"]
TEXT = [b"\r\n", b"\r", b"\n", b"--", b"-", b" ", b"\t", b"v", b"X", b"Y", b"--X", b"--Y"]
TEXT += [b"\r\n--X", b"\r\n--Y", b"\r\n\r\n", b"--XY", b":", b"\r\nv--X\r\n", b"\r\nv--Y"]
HEADERS = [
    b'Content-Disposition: form-data; name="f"',
    b'Content-Disposition: form-data; name="g"; filename="h.txt"',
    b'Content-Disposition: form-data; name="g"; filename="i.txt"\r\nContent-Type: text/plain',
]


@st.composite
def multipart_pieces(draw: st.DrawFn) -> list[bytes | None]:
    pieces: list[bytes | None] = []
    if draw(st.booleans()):  # a preamble, perhaps one python-multipart skips (after a line end)
        pieces += draw(st.lists(st.sampled_from(TEXT), min_size=1, max_size=3))
    for _ in range(draw(st.integers(0, 3))):
        pieces += [None, draw(st.sampled_from([b"", b" ", b"\t", b"x"])), b"\r\n"]
        # (mostly a blank line after the headers; sometimes none: a reader then takes the next
        # delimiter's line end as the blank line, and the delimiter's text as the part's data)
        pieces += [
            draw(st.sampled_from(HEADERS)),
            draw(st.sampled_from([b"\r\n\r\n"] * 3 + [b"\r\n"])),
        ]
        pieces += draw(st.lists(st.sampled_from(TEXT), max_size=3))
        pieces.append(b"\r\n")
    if draw(st.integers(0, 4)):  # mostly closed, sometimes cut short
        pieces += [None, b"--", draw(st.sampled_from([b"", b"\r\n", b"\r\nepilogue", b" "]))]
    for _ in range(draw(st.integers(0, 2))):  # stray text anywhere
        at = draw(st.integers(0, len(pieces)))
        pieces.insert(at, draw(st.sampled_from(TEXT)))
    return pieces


def render(pieces: list[bytes | None], boundary: bytes) -> bytes:
    return b"".join(b"--" + boundary if piece is None else piece for piece in pieces)


# Starlette (1.10) never closes the upload it opened for a part a body cut short leaves unfinished
# (python-multipart reads such a body as a form without that part): the garbage collector does.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@PROPERTY
# python-multipart skips a preamble that starts with a line end up to the first "-", and takes
# a "--X" there as the first delimiter with no line end before it: one body is a form, the
# other (no "--Y" there) refused. So the delimiter's text anywhere but after a line end means
# the body is hashed as sent.
@example([b"\r\nv--X\r\n", HEADERS[0], b"\r\n\r\nv\r\n", None, b"--"], b"X", b"Y")
# No delimiter at all: python-multipart refuses `----` under boundary X and reads it as an empty
# form under `----WebKitFormBoundaryQ7` (a prefix of its delimiter), so such a body is hashed as
# sent, its boundary with it.
@example([b"--", b"--"], b"X", b"----WebKitFormBoundaryQ7")
# A part whose headers end with no blank line: python-multipart takes the next delimiter's line
# end as the blank line, so the delimiter's text (the boundary) is that part's data.
@example(
    [
        None,
        b"\r\n",
        HEADERS[0],
        b"\r\n\r\n",
        None,
        b"\r\n",
        HEADERS[0],
        b"\r\n\r\nv\r\n",
        None,
        b"--",
    ],
    b"X",
    b"Y",
)
@given(multipart_pieces(), st.sampled_from(BOUNDARIES), st.sampled_from(BOUNDARIES))
def test_equal_multipart_fingerprints_read_alike_to_starlette(
    pieces: list[bytes | None], boundary_a: bytes, boundary_b: bytes
) -> None:
    type_a = b'multipart/form-data; boundary="' + boundary_a + b'"'
    type_b = b'multipart/form-data; boundary="' + boundary_b + b'"'
    body_a, body_b = render(pieces, boundary_a), render(pieces, boundary_b)
    a = digest(type_a, body_a)
    if a is not None and a == digest(type_b, body_b):
        assert reading(type_a, body_a) == reading(type_b, body_b)


def test_a_retry_under_a_new_boundary_reads_alike_and_matches() -> None:
    """The case the boundary's removal is for: a client's retry draws a new boundary."""
    pieces: list[bytes | None] = [None, b"\r\n", HEADERS[1], b"\r\n\r\n", b"--X", b"\r\n"]
    pieces += [None, b"--\r\n"]
    type_a = b"multipart/form-data; boundary=----WebKitFormBoundaryQ7"
    type_b = b"multipart/form-data; boundary=XY"
    body_a, body_b = render(pieces, b"----WebKitFormBoundaryQ7"), render(pieces, b"XY")
    assert digest(type_a, body_a) == digest(type_b, body_b) is not None
    assert (
        reading(type_a, body_a)
        == reading(type_b, body_b)
        == {
            "g": [
                (
                    "h.txt",
                    None,
                    [("content-disposition", 'form-data; name="g"; filename="h.txt"')],
                    b"--X",
                )
            ]
        }
    )


# Urlencoded: a body and a reordering of it, one piece perhaps replaced.

PIECE_TEXT = [b"a", b"b", b"A", b"=", b"%", b"%41", b"+", b"%20", b" ", b";", b"[", b"]", b"."]
PIECE_TEXT += [b"\xc3\xa9", b"%C3", b"%e9", b"_charset_", b"'", b"*", b"?", b"/", b"&"]
PIECE = st.lists(st.sampled_from(PIECE_TEXT), max_size=4).map(b"".join)


@PROPERTY
@given(st.lists(PIECE, min_size=1, max_size=4), st.randoms(use_true_random=False), PIECE)
def test_equal_form_fingerprints_read_alike_to_starlette(
    pieces: list[bytes], random: Any, other: bytes
) -> None:
    first = b"&".join(pieces)
    shuffled = list(pieces)
    random.shuffle(shuffled)
    if random.random() < 0.3:
        shuffled[random.randrange(len(shuffled))] = other
    second = b"&".join(shuffled)
    a = digest(FORM, first)
    if a is not None and a == digest(FORM, second):
        assert reading(FORM, first) == reading(FORM, second)
