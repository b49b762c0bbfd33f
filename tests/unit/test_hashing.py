"""The request path's SHA-256: CPython's builtin where there is one, the same digests as hashlib."""

from __future__ import annotations

import hashlib
import importlib.util
import random
from typing import Any

import pytest

from idem_middleware import hashing
from idem_middleware.hashing import sha256


def test_the_builtin_is_used_where_the_interpreter_has_one() -> None:
    have = [name for name in ("_sha2", "_sha256") if importlib.util.find_spec(name) is not None]
    if not have:
        pytest.skip("this interpreter was built without a builtin SHA-256")
    assert sha256 is not hashlib.sha256
    assert type(sha256(b"")).__module__ in have


def test_without_a_builtin_hashlib_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_BUILTIN_MODULES", ("_no_such_sha256_module",))
    assert hashing._builtin_sha256() is hashlib.sha256


def test_the_digests_are_hashlibs_for_any_length() -> None:
    rng = random.Random(7)
    for size in [*range(0, 200), 511, 512, 513, 4096, 65_537]:
        data = rng.randbytes(size)
        assert sha256(data).digest() == hashlib.sha256(data).digest(), size


def test_a_copied_state_goes_on_as_hashlibs_does() -> None:
    # The claim lock's use: a state read once, copied and extended per claim.
    rng = random.Random(11)
    for _ in range(200):
        head, tail = rng.randbytes(rng.randrange(0, 130)), rng.randbytes(rng.randrange(0, 130))
        ours, theirs = sha256(head), hashlib.sha256(head)
        copied = ours.copy()
        copied.update(tail)
        assert copied.digest() == hashlib.sha256(head + tail).digest()
        assert ours.digest() == theirs.digest()  # the original is untouched by the copy's update


def test_a_fingerprint_hashes_a_short_stream_with_the_builtin_and_a_long_one_with_openssl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past SHORT_INPUT bytes OpenSSL's per-byte speed wins (several times CPython's on a 1 MiB
    body): a long body's fingerprint must not take the builtin."""
    from idem_middleware import Policy
    from idem_middleware import fingerprint as fp

    used: list[tuple[str, int]] = []

    def recording(name: str, constructor: Any) -> Any:
        def construct(data: bytes) -> Any:
            used.append((name, len(data)))
            return constructor(data)

        return construct

    # (A head shorter than a block: every stream is hashed whole, per request.)
    fingerprinter = fp.Fingerprinter("POST /p", {}, Policy())
    assert fingerprinter._head_state is None
    bodies = [b'{"memo": "' + b"x" * size + b'"}' for size in (1, 100, 1_000, 100_000)]
    # What hashlib alone makes of them:
    monkeypatch.setattr(fp, "sha256", hashlib.sha256)
    monkeypatch.setattr(fp, "long_sha256", hashlib.sha256)
    expected = [fingerprinter(b"", [], b"application/json", body) for body in bodies]
    monkeypatch.setattr(fp, "sha256", recording("builtin", hashing.sha256))
    monkeypatch.setattr(fp, "long_sha256", recording("openssl", hashing.long_sha256))
    for body, digest in zip(bodies, expected, strict=True):
        assert fingerprinter(b"", [], b"application/json", body) == digest
        name, length = used[-1]
        assert name == ("builtin" if length <= hashing.SHORT_INPUT else "openssl"), used
    assert [name for name, _ in used] == ["builtin", "builtin", "openssl", "openssl"]


#: Fingerprints of four requests as every version so far has computed them: stored records are
#: compared with fingerprints computed by later versions, so the bytes hashed must never change.
#: (The long route's head is a whole SHA-256 block and more, the short one's less; the third
#: body makes the stream too long for the builtin; the fourth adds a query and a header.)
_PINNED = [
    ("POST /accounts/{account_id}/credits", {"account_id": "acc-1"}, (), b"", b'{"amount": 5}',
     "dda1083f1eaa5e1cec728b2fff03cbdb6ce8352a4bc502418997bd3c27885806"),
    ("POST /payments", {}, (), b"", b'{"amount": 5}',
     "64861b1167a7a8cdffe15b348b8e1cf32aacc562d5aab90289b5f16df96c47ed"),
    ("POST /accounts/{account_id}/credits", {"account_id": "acc-1"}, (), b"",
     b'{"memo": "' + b"x" * 300 + b'"}',
     "77eb6adec012fc499fbc8b46756328189b76e47b644137787e2ccdf1f2f60bf2"),
    ("POST /accounts/{account_id}/credits", {"account_id": "acc-1"}, ("X-Tenant-Region",),
     b"b=2&a=1", b'{"amount": 5}',
     "9a582d53f9c46164d34fd8c09a94495f7ee90fd921f764289489362aba4b8212"),
]  # fmt: skip


@pytest.mark.parametrize(("operation", "params", "headers", "query", "body", "expected"), _PINNED)
def test_the_fingerprints_of_known_requests_do_not_change(
    operation: str,
    params: dict[str, str],
    headers: tuple[str, ...],
    query: bytes,
    body: bytes,
    expected: str,
) -> None:
    from idem_middleware import Policy
    from idem_middleware.fingerprint import Fingerprinter

    fingerprinter = Fingerprinter(operation, params, Policy(include_headers=list(headers)))
    sent = [(b"x-tenant-region", b"eu")]
    assert fingerprinter(query, sent, b"application/json", body).hex() == expected


def test_a_long_head_is_hashed_once_per_path_and_gives_the_same_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A path's operation and parameters (its head) are the same in every request: a head of a
    whole block or more is hashed at the path's second request (a path with an id in it is
    mostly met once: its first request hashes the whole stream, as a short head's do), and each
    request after hashes only its own part, in a copy of that state, with the same digest as
    the whole stream hashed anew. Heads on both sides of a block, streams on both sides of
    SHORT_INPUT."""
    from idem_middleware import Policy
    from idem_middleware import fingerprint as fp

    rng = random.Random(5)
    cases = []
    for _ in range(150):
        name = "x" * rng.randrange(1, 160)
        params = {f"p{i}": "v" * rng.randrange(0, 40) for i in range(rng.randrange(0, 3))}
        body = b'{"memo": "' + b"m" * rng.randrange(0, 320) + b'"}'
        cases.append((f"POST /{name}", params, body))
    ours = [fp.Fingerprinter(op, params, Policy()) for op, params, _ in cases]
    kept = fp.Fingerprinter("POST /" + "x" * 100, {}, Policy())
    # The same requests with no head ever kept: the whole stream hashed per request.
    monkeypatch.setattr(fp, "_HEAD_STATE_MIN", 10**9)
    plain = [fp.Fingerprinter(op, params, Policy()) for op, params, _ in cases]
    monkeypatch.undo()
    for request in ("first", "second", "third"):
        for (_, _, body), mine, whole in zip(cases, ours, plain, strict=True):
            digest = mine(b"", [], b"application/json", body)
            assert digest == whole(b"", [], b"application/json", body), request
        if request == "first":
            assert all(f._head_state is None for f in ours)  # nothing hashed ahead of need
        else:
            assert any(f._head_state is not None for f in ours)
            assert any(f._head_state is None for f in ours)
    assert all(f._head_state is None for f in plain)

    # Per request, a short stream behind a kept head is not hashed from its start.
    hashed: list[tuple[str, int]] = []

    def counting(name: str) -> Any:
        def construct(data: bytes) -> Any:
            hashed.append((name, len(data)))
            return hashlib.sha256(data)

        return construct

    kept(b"", [], b"application/json", b"{}")
    assert kept._head_state is None  # a path's first request: its head is not hashed apart
    kept(b"", [], b"application/json", b"{}")
    assert kept._head_state is not None
    monkeypatch.setattr(fp, "sha256", counting("builtin"))
    monkeypatch.setattr(fp, "long_sha256", counting("openssl"))
    kept(b"", [], b"application/json", b'{"amount": 5}')
    assert hashed == []
    # A long one is OpenSSL's, from the head on (its per-byte speed wins).
    kept(b"", [], b"application/json", b'{"memo": "' + b"m" * 300 + b'"}')
    [(name, size)] = hashed
    assert name == "openssl"
    assert size > hashing.SHORT_INPUT
