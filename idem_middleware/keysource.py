"""Where a route's idempotency key comes from: a request header, a member of the JSON body, or a
function of the request. `Policy(key_source=...)`; without one, the `Idempotency-Key` header.

Whatever the source, a key is held to the header's rules (1 to 255 printable ASCII characters)
and lives in the caller's tenant, like any other key."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, ClassVar

from starlette.types import Message, Receive, Scope

from .errors import ConfigurationError, ProblemKind, RequestRejected
from .fingerprint import is_json_pointer, json_member
from .fingerprint_json import canonical_json, parse_json_strict
from .keys import MAX_KEY_LENGTH, check_key, parse_key_value

if TYPE_CHECKING:
    from .exchange import Exchange

__all__ = [
    "KeyFromBody",
    "KeyFromFunction",
    "KeyFromHeader",
    "KeyFunction",
    "KeySource",
    "as_key_source",
]

#: `(scope, body) -> key or None`, sync or async: the body is the whole request body, read (and
#: capped by `max_body_bytes`) before the function is called.
KeyFunction = Callable[[Scope, bytes], str | Awaitable[str | None] | None]

# RFC 9110 field names (tokens).
FIELD_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_KEY_RULE = f"1 to {MAX_KEY_LENGTH} printable ASCII characters"


class KeySource:
    """Base of the key sources: `find` returns the key, None when the request carries none, or
    raises RequestRejected when it carries one that is not a valid key."""

    __slots__ = ()

    #: Whether `find` needs the body (read, and capped, before the key is known).
    reads_body: ClassVar[bool] = False

    def describe(self) -> str:
        """Where the key is looked for, for a client's error message."""
        raise NotImplementedError

    def find(
        self, scope: Scope, body: bytes, *, max_json_values: int
    ) -> str | Awaitable[str | None] | None:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class KeyFromHeader(KeySource):
    """A request header, read exactly as `Idempotency-Key` is (an RFC 8941 string or a bare
    token; sent once)."""

    name: str = "Idempotency-Key"
    _raw: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or FIELD_NAME.fullmatch(self.name) is None:
            raise ConfigurationError(f"KeyFromHeader: {self.name!r} is not a header name")
        object.__setattr__(self, "_raw", self.name.lower().encode("ascii"))

    def describe(self) -> str:
        return f"the {self.name} header"

    def find(self, scope: Scope, body: bytes, *, max_json_values: int) -> str | None:
        wanted = self._raw
        raw: bytes | None = None
        for name, value in scope["headers"]:
            if len(name) == len(wanted) and name.lower() == wanted:
                if raw is not None:
                    raise RequestRejected(
                        ProblemKind.INVALID_KEY, f"The {self.name} header must be sent only once."
                    )
                raw = value
        return None if raw is None else parse_key_value(raw, self.name)


@dataclass(frozen=True, slots=True)
class KeyFromBody(KeySource):
    """A member of the JSON body, by JSON Pointer (`"/event/id"`, `"/data/0/id"`): for webhook
    receivers whose sender puts an event id in the body. The member must be a string, or an
    integer (rendered as canonical JSON writes it: `1e3` and `1000` are the key `"1000"`, as is
    the string `"1000"`). A missing member, a null, or an empty body is no key; a body that is
    not JSON is `400 body-invalid`."""

    pointer: str
    reads_body: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.pointer, str) or not is_json_pointer(self.pointer):
            raise ConfigurationError(
                f"KeyFromBody: {self.pointer!r} is not a JSON Pointer: write '/event_id' for a "
                "top-level member, '/event/id' for a nested one (with ~0 for '~', ~1 for '/')"
            )

    def describe(self) -> str:
        return f"the JSON body's member {self.pointer}"

    def find(self, scope: Scope, body: bytes, *, max_json_values: int) -> str | None:
        if not body:
            return None
        found, value = json_member(
            parse_json_strict(body, max_values=max_json_values), self.pointer
        )
        if not found or value is None:
            return None
        if isinstance(value, str):
            key = value
        elif isinstance(value, int | Decimal) and not isinstance(value, bool):
            if isinstance(value, Decimal) and value != value.to_integral_value():
                raise self._bad("is a number that is not an integer")
            key = canonical_json(int(value)).decode("ascii")  # 1e3 and 1000 alike
        else:
            raise self._bad("must be a string or an integer")
        try:
            return check_key(key)
        except RequestRejected:
            raise self._bad(f"must be {_KEY_RULE}") from None

    def _bad(self, what: str) -> RequestRejected:
        return RequestRejected(
            ProblemKind.INVALID_KEY, f"The idempotency key at {self.pointer} in the body {what}."
        )


@dataclass(frozen=True, slots=True)
class KeyFromFunction(KeySource):
    """A function of the request, `(scope, body) -> str | None` (sync or async), called once the
    body is read. It may raise RequestRejected to refuse the request with its own problem; a key
    it returns is held to the header's rules; anything but a str or None is a
    ConfigurationError. `where` ("the X-Webhook-Id header", say) names the source in the
    problem a client gets when there is no key."""

    function: KeyFunction
    where: str = ""
    reads_body: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not callable(self.function):
            raise ConfigurationError(f"key_source: {self.function!r} is not callable")
        if not isinstance(self.where, str):  # (shown to clients: text, never a repr)
            raise ConfigurationError(f"key_source: where={self.where!r} is not a str")
        try:
            inspect.signature(self.function).bind(None, b"")
        except TypeError:
            raise ConfigurationError(
                f"key_source: {_name(self.function)} must take (scope, body)"
            ) from None
        except ValueError:
            pass  # no signature to read (some builtins): trust it

    def describe(self) -> str:
        return self.where or f"the request, by {_name(self.function)}"

    async def find(self, scope: Scope, body: bytes, *, max_json_values: int) -> str | None:
        key = self.function(scope, body)
        if inspect.isawaitable(key):
            key = await key
        if key is None:
            return None
        if not isinstance(key, str):
            raise ConfigurationError(
                f"key_source {_name(self.function)} returned {type(key).__name__}, not str or None"
            )
        try:
            return check_key(key)
        except RequestRejected:
            raise RequestRejected(
                ProblemKind.INVALID_KEY,
                f"The idempotency key taken from {self.describe()} must be {_KEY_RULE}.",
            ) from None


def _name(function: object) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def as_key_source(value: object) -> KeySource | None:
    """A Policy's `key_source` as given: None (the Idempotency-Key header), a KeySource, or a
    function of the request (wrapped in KeyFromFunction)."""
    if value is None or isinstance(value, KeySource):
        return value
    if isinstance(value, str | bytes):
        raise ConfigurationError(
            f"key_source must be a KeySource or a function, not the string {value!r}: write "
            f"KeyFromHeader({value!r}) or KeyFromBody({value!r})"
        )
    if callable(value):
        return KeyFromFunction(value)
    raise ConfigurationError(f"key_source must be a KeySource or a function, not {value!r}")


async def take_key(ex: Exchange, source: KeySource | KeyFunction) -> str | None:
    """The key of the request `ex` handles, from `source`; None when there is none and the
    policy does not require one. A missing required key is `400 missing-key` naming where it
    was looked for. A source that reads the body reads it here, and the request's `receive`
    then hands it over again, so the rest of the exchange (and an unguarded app) sees it."""
    policy = ex.policy
    if not isinstance(source, KeySource):
        source = KeyFromFunction(source)  # a Policy has wrapped it already; a test may not have
    body = b""
    if source.reads_body:
        _, read = await ex.read_body()
        if read is None:
            # No body, so no key; and no app runs for a client that has already left.
            raise RequestRejected(
                ProblemKind.BODY_INVALID, "The client disconnected before sending its body."
            )
        body = read
        ex.receive = _replaying(body, ex.receive)
    key = source.find(ex.scope, body, max_json_values=policy.max_json_values)
    if inspect.isawaitable(key):
        key = await key
    if key is not None and type(source) not in _CHECKING:
        key = _held_to_the_rules(key, source)  # (an app's own source: its answer unchecked)
    if key is None and policy.key_required:
        raise RequestRejected(
            ProblemKind.MISSING_KEY,
            "The request carries no idempotency key; this operation reads it from "
            f"{source.describe()}.",
        )
    return key


#: The sources whose `find` holds its key to the header's rules itself.
_CHECKING = (KeyFromHeader, KeyFromBody, KeyFromFunction)


def _held_to_the_rules(key: object, source: KeySource) -> str:
    """The key a source of the app's own (a KeySource subclass) found, held to the header's
    rules as the library's own sources' are: sent to the store as it came, an empty or
    oversized key was a 500 from the database after the handler ran, an int or bytes the
    driver's error, and the in-memory store took either."""
    if not isinstance(key, str):
        raise ConfigurationError(
            f"key_source {type(source).__qualname__} found a {type(key).__name__}, not a str "
            "or None"
        )
    try:
        return check_key(key)
    except RequestRejected:
        raise RequestRejected(
            ProblemKind.INVALID_KEY,
            f"The idempotency key taken from {source.describe()} must be {_KEY_RULE}.",
        ) from None


def _replaying(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay_receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive
