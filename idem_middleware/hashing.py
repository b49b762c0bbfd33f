"""SHA-256 for the request path: CPython's own implementation for short inputs, OpenSSL's for
the rest.

`hashlib.sha256` is OpenSSL's. Its digest of a short input is the quicker in a loop of its own
(0.5 µs against 0.9 at 100 bytes), but each call goes through OpenSSL's EVP layer (a context
allocated, the digest looked up, the context copied for `digest()`), a dozen small functions
spread over libcrypto, and in place, between a FastAPI handler's own work, they run cache-cold:
timed request by request, a guarded request whose fingerprint hashed 183 bytes cost 1.1-1.7 µs
more with OpenSSL's digest than with CPython's builtin module, a single small function
(docs/performance-history.md). Per byte, though, OpenSSL is several times quicker (it uses the
CPU's SHA instructions where there are some): 0.75 ms against 5.3 ms for 1 MiB. So inputs up to
`SHORT_INPUT` bytes go to CPython's, longer ones to OpenSSL's. The digests are the same bytes.

Where the interpreter has no builtin SHA-256 (a build without it), `hashlib.sha256` does all.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _hashlib import HASH

__all__ = ["SHORT_INPUT", "long_sha256", "sha256"]

#: The builtin module per CPython version: `_sha2` from 3.12, `_sha256` before.
_BUILTIN_MODULES = ("_sha2", "_sha256")

#: The longest input `sha256` should get: past it OpenSSL's per-byte speed wins (in a loop the
#: two are 0.6 µs apart at 300 bytes and 1.7 µs at 500; in place CPython's saves 1.1-1.7 µs).
SHORT_INPUT = 256


def _builtin_sha256() -> Callable[[bytes], HASH]:
    for name in _BUILTIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        constructor: Callable[[bytes], HASH] = module.sha256
        return constructor
    return hashlib.sha256


#: `sha256(data)` for data of at most SHORT_INPUT bytes (or a state extended by that little):
#: a hash object with `update`, `copy` and `digest`, as hashlib's.
sha256: Callable[[bytes], HASH] = _builtin_sha256()
#: `long_sha256(data)` for anything longer: OpenSSL's.
long_sha256: Callable[[bytes], HASH] = hashlib.sha256
