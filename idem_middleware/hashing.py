"""SHA-256 for the request path: CPython's own implementation where the interpreter has one.

`hashlib.sha256` is OpenSSL's. Its digest of a short input is the quicker in a loop of its own
(0.5 µs against 0.9), but each call goes through OpenSSL's EVP layer (a context allocated, the
digest looked up, the context copied for `digest()`), a dozen small functions spread over
libcrypto, and in place, between a FastAPI handler's own work, they run cache-cold: timed
request by request, a guarded request cost 1.1-1.7 µs more with OpenSSL's digest than with
CPython's builtin module, a single small function (docs/performance.md). The digests are the
same bytes: SHA-256 is SHA-256.

Where the interpreter has no builtin SHA-256 (a build without it), `hashlib.sha256` is used.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _hashlib import HASH

__all__ = ["sha256"]

#: The builtin module per CPython version: `_sha2` from 3.12, `_sha256` before.
_BUILTIN_MODULES = ("_sha2", "_sha256")


def _builtin_sha256() -> Callable[[bytes], HASH]:
    for name in _BUILTIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        constructor: Callable[[bytes], HASH] = module.sha256
        return constructor
    return hashlib.sha256


#: `sha256(data)`: a hash object with `update`, `copy` and `digest`, as hashlib's.
sha256: Callable[[bytes], HASH] = _builtin_sha256()
