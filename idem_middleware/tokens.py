"""One-time submission tokens: issued by the server, sent back as the request's Idempotency-Key.

A route with `Policy(require_token=True)` accepts only keys that are live tokens issued to the
caller's tenant for that operation (and, if bound, for that request). Consuming a token IS the
claim of its idempotency record, so a token used just before a crash is answered by the state
machine (in flight, unknown, replay), never by a bare "token already used".
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .context import token_hash
from .endpoints import not_idempotent
from .errors import (
    ConfigurationError,
    ProblemKind,
    RequestRejected,
    StatementRefused,
    StoreError,
)
from .errors import TokenConflict as TokenConflict
from .fingerprint_json import parse_json_strict
from .library_routes import ROUTE_OPERATIONS_ATTRIBUTE, GuardedOperations, LibraryRoute
from .responses import problem_response
from .store.base import RecordKey, State, TokenRow
from .tenant import (
    ROUTE_RESOLVER_ATTRIBUTE,
    ROUTE_TENANTS_ATTRIBUTE,
    TenantResolver,
    Tenants,
    authenticated_user_tenant,
    route_tenant,
)
from .token_values import (
    MAX_INTENT_ID,
    checked_request,
    good_intent,
    good_operation,
    time_to_live,
)

_PREFIX = "it_"
#: How many times `issue` reads again after a concurrent issue of the same intent won the race
#: on the token's primary key (the second attempt already sees the winner's row).
_ISSUE_ATTEMPTS = 4
#: How long `issue` waits, and how often it asks again, for a request consuming the intent's
#: expired token to end (about 5 s; then StoreError: the token route's 503, to ask again).
_BUSY_PAUSES = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32) + (0.5,) * 9
#: The longest `intent_id` the token route accepts (characters).
#: The largest body the token route reads (bytes): the longest operation and intent, every
#: character escaped, fit many times over, so a value too long is still told apart (400). The
#: middleware never guards the route, so its `max_body_bytes` does not apply.
MAX_TOKEN_REQUEST_BYTES = 1024 * 1024
_BAD_BODY = (
    'Expected {"operation": "METHOD /path-template", "intent_id": str?} (an intent_id of at most'
    f" {MAX_INTENT_ID} characters, without NUL or unpaired surrogates)."
)


def _unique_violation(exc: StatementRefused) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == "23505" or "UniqueViolation" in str(exc)


@dataclass(frozen=True, slots=True)
class IssuedToken:
    token: str
    expires_at: datetime


class TokenIssuer:
    """Issues tokens through the store (`store.issue_token`: PostgreSQL's, or the in-memory
    twin's).

    `secret` (at least 32 bytes; keep it like any signing key) makes issuance idempotent: a
    token for an `intent_id` is an HMAC of the tenant, operation and intent, so asking again for
    the same intent returns the same token without the token ever being stored. Tokens without an
    intent are 256 random bits from `secrets`.

    A token is consumed by the claim it admits. Asking again for an intent whose token was used
    returns that token while it is live (a retry with it gets the stored outcome), and raises
    TokenConflict once it has expired: it is never renewed. Purge keeps the consumed tokens of
    intents as tombstones: an intent's token is the same every time, so only that row tells a
    re-issue from a first issue. Delete them yourself only for intents that can never be asked
    for again (`DELETE FROM idem_tokens WHERE consumed_at < ...`): those intents reopen.

    To rotate the secret, pass the old one in `previous_secrets`: tokens already issued are
    consumed as before (a claim looks a token up by its hash, never by the secret), and asking
    again for an intent issued under an old secret returns that intent's token, instead of a
    TokenConflict, for as long as the old secret is listed.
    """

    def __init__(
        self,
        store: Any,
        *,
        secret: bytes,
        ttl_seconds: float = 3600.0,
        previous_secrets: Iterable[bytes] = (),
    ) -> None:
        if isinstance(previous_secrets, (bytes, str)):
            raise TypeError("previous_secrets is a sequence of secrets, not one secret")
        # (Read once: an iterator, map(...) say, was used up by the check, no old secret kept.)
        previous_secrets = tuple(previous_secrets)
        for given in (secret, *previous_secrets):
            if not isinstance(given, (bytes, bytearray)):
                raise TypeError(f"a token secret is bytes (encode it), not {type(given).__name__}")
            if len(given) < 32:
                raise ValueError("the token secret must be at least 32 bytes")
        ttl_seconds = time_to_live(ttl_seconds)
        if not callable(getattr(store, "issue_token", None)):
            raise TypeError(
                f"TokenIssuer issues through a store's issue_token (PostgresStore's, or the"
                f" MemoryStore's), which {type(store).__name__} has not"
            )
        self.store = store
        self._secret = bytes(secret)
        self._previous = tuple(bytes(old) for old in previous_secrets)
        self.ttl_seconds = ttl_seconds

    def _token_for(
        self, tenant: str, operation: str, intent_id: str | None, secret: bytes | None = None
    ) -> str:
        if intent_id is None:
            raw = secrets.token_bytes(32)
        else:
            parts = ("idem-token-1", tenant, operation, intent_id)
            message = b"\x00".join(p.encode() for p in parts)
            key = self._secret if secret is None else secret
            raw = hmac.new(key, message, hashlib.sha256).digest()
        return _PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    def _under_previous(
        self, stored: bytes, tenant: str, operation: str, intent_id: str | None
    ) -> str | None:
        """The intent's token under the old secret it was issued with, if one is listed."""
        for old in self._previous:
            token = self._token_for(tenant, operation, intent_id, old)
            if hmac.compare_digest(token_hash(token), stored):
                return token
        return None

    async def issue(
        self,
        tenant: str,
        operation: str,
        *,
        intent_id: str | None = None,
        request_digest: bytes | None = None,
        ttl_seconds: float | None = None,
    ) -> IssuedToken:
        """A token for `operation` (e.g. "POST /payouts"), bound to `request_digest` if given.

        Asking again for an intent returns its token only for the same `request_digest` (None,
        unbound, included): any other digest is TokenConflict. Concurrent calls for one intent
        all return the same token. `ttl_seconds`, if given, must be positive and finite (at most
        100 years, as a Policy's durations).
        """
        tenant, operation, intent_id, request_digest = checked_request(
            tenant, operation, intent_id, request_digest
        )
        ttl_seconds = self.ttl_seconds if ttl_seconds is None else time_to_live(ttl_seconds)
        token = self._token_for(tenant, operation, intent_id)
        hashed = token_hash(token)
        asked = (tenant, hashed, operation, request_digest, intent_id, ttl_seconds)
        row = await self._settled(asked, token)
        for pause in _BUSY_PAUSES:
            if row is not None:
                break
            # A request consuming the intent's expired token still runs: what it leaves (the
            # token used, or free to renew) is known when it ends. Waited for here, with no
            # connection held (never in the database).
            await asyncio.sleep(pause)
            row = await self._settled(asked, token)
        if row is None:
            raise StoreError("a request consuming this intent's token still runs; ask again")
        if row.token_hash != hashed:
            older = (
                None
                if intent_id is None
                else self._under_previous(row.token_hash, tenant, operation, intent_id)
            )
            if older is None:
                raise TokenConflict("this intent was issued a token under another secret")
            token = older
        if row.spent:
            raise TokenConflict("this intent's token was already used; it is not issued again")
        if row.request_digest != request_digest:
            raise TokenConflict("this intent was issued a token for a different request")
        return IssuedToken(token, row.expires_at)

    async def _settled(self, asked: tuple[Any, ...], token: str) -> TokenRow | None:
        """The intent's row (`_issued(*asked)`); None while a request consuming its token still
        runs (the store says busy, or the token is spent by a lease-mode request not ended)."""
        row = await self._issued(*asked)
        if row is None or (row.spent and await self._still_runs(asked[0], asked[2], token)):
            return None
        return row

    async def _still_runs(self, tenant: str, operation: str, token: str) -> bool:
        """Whether a lease-mode request that consumed the token still runs: its claim committed
        the token used at once, and its end may free it again (a 4xx), so `spent` is no answer
        until then. (A transactional one holds the token's row: the store says `busy`.)"""
        record = await self.store.get(RecordKey(tenant, operation, token))
        return (
            record is not None
            and record.state is State.PENDING
            and not (record.lease_expired or record.retry_allowed)
        )

    async def _issued(
        self,
        tenant: str,
        hashed: bytes,
        operation: str,
        request_digest: bytes | None,
        intent_id: str | None,
        ttl_seconds: float,
    ) -> TokenRow | None:
        """The store's `issue_token` (None: busy, see `issue`)."""
        for attempt in range(_ISSUE_ATTEMPTS):
            try:
                row: TokenRow | None = await self.store.issue_token(
                    tenant,
                    hashed,
                    operation,
                    request_digest=request_digest,
                    intent_id=intent_id,
                    ttl_seconds=ttl_seconds,
                )
                return row
            except StatementRefused as exc:
                # Two first issues of one intent insert the same token: the loser may collide
                # on the token's primary key rather than on the intent's key that ON CONFLICT
                # names. The winner's row is committed by now, so asking again returns it.
                if (
                    intent_id is None
                    or not _unique_violation(exc)
                    or attempt == _ISSUE_ATTEMPTS - 1
                ):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover


async def _capped_body(request: Request) -> bytes | None:
    """The body, or None once it passes MAX_TOKEN_REQUEST_BYTES (read no further)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_TOKEN_REQUEST_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def token_route(
    issuer: TokenIssuer,
    *,
    path: str = "/idempotency/tokens",
    tenant_resolver: TenantResolver = authenticated_user_tenant,
    problem_base: str | None = None,
    www_authenticate: str | None = None,
) -> Route:
    """`POST path` with `{"operation": "POST /payouts", "intent_id": "..."?}` issues a token to
    the authenticated tenant: 201 `{"token", "expires_at"}` (the same token for the same intent).
    Refusals are problem+json under the middleware's `problem_base` (as for `status_route`: leave
    it out, or give the middleware's), a 401 with `www_authenticate` as its challenge (pass the
    middleware's, if it has its own).
    The route is `not_idempotent`: the middleware never guards it (a client needs no key, and no
    token, to get its first token; asking again for an intent is already idempotent). Once the
    middleware's startup check has seen it, an operation that takes no token (not guarded, or
    without `require_token`) is 400 body-invalid, and nothing is issued.
    """
    if not isinstance(issuer, TokenIssuer):  # (a store in its place failed every request)
        raise ConfigurationError(f"token_route() takes a TokenIssuer, not {issuer!r}")
    tenants = Tenants(tenant_resolver, challenge=www_authenticate)
    # Filled by the middleware's startup check: which operations take tokens.
    operations = GuardedOperations("tokens", problem_base, issuer.store)

    def bad_body(detail: str = _BAD_BODY) -> Response:
        return problem_response(ProblemKind.BODY_INVALID, detail, base=operations.base)

    @not_idempotent
    async def issue(request: Request) -> Response:
        tenant = await route_tenant(tenants, request.scope, problem_base=operations.base)
        if isinstance(tenant, Response):
            return tenant
        raw = await _capped_body(request)
        if raw is None:
            return problem_response(
                ProblemKind.BODY_TOO_LARGE,
                f"The body may be at most {MAX_TOKEN_REQUEST_BYTES} bytes.",
                base=operations.base,
            )
        try:
            # I-JSON, as the guarded routes read bodies: with a member given twice, a gateway
            # reading the first `operation` and this route the last would see two requests.
            body: Any = parse_json_strict(raw)
            operation = body["operation"]
            intent_id = body.get("intent_id")
            if not isinstance(operation, str) or not (
                intent_id is None or isinstance(intent_id, str)
            ):
                raise TypeError
        except RequestRejected as exc:
            return bad_body(exc.detail)
        except (KeyError, TypeError, AttributeError):
            return bad_body()
        if not good_operation(operation) or not good_intent(intent_id):
            return bad_body()
        # A token for an operation that takes none would never be asked for (or, for a typo,
        # be refused as another operation's at its first use): say so now, nothing issued.
        if (refused := operations.takes_tokens(operation)) is not None:
            return bad_body(refused)
        try:
            issued = await issuer.issue(tenant, operation, intent_id=intent_id)
        except TokenConflict as exc:
            return problem_response(ProblemKind.TOKEN_CONFLICT, f"{exc}.", base=operations.base)
        except StatementRefused:
            # The database refused these values (the checks above should leave nothing here).
            return bad_body()
        except StoreError:
            # As the guarded routes answer it: a 503 to retry (asking again for an intent is
            # idempotent), not a bare 500.
            return problem_response(
                ProblemKind.STORE_UNAVAILABLE,
                "No token can be issued right now; ask again.",
                base=operations.base,
                retry_after=1,
            )
        body = {"token": issued.token, "expires_at": issued.expires_at.isoformat()}
        # A token is a one-time credential: no cache keeps it (as for OAuth's token responses).
        headers = {"cache-control": "no-store"}
        return Response(orjson.dumps(body), 201, headers=headers, media_type="application/json")

    setattr(issue, ROUTE_RESOLVER_ATTRIBUTE, tenant_resolver)  # (see startup's check)
    setattr(issue, ROUTE_TENANTS_ATTRIBUTE, tenants)
    setattr(issue, ROUTE_OPERATIONS_ATTRIBUTE, operations)
    return LibraryRoute(path, issue, method="POST", name="idempotency_tokens")
