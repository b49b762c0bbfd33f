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

    fingerprinter = fp.Fingerprinter("POST /p/{id}", {"id": "7"}, Policy())
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
