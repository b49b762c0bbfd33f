"""Routes that share an operation's name share its records, and the status route, the token
route and the CLI read one policy per operation: routes of one name that differ in their
reconciler alone (one lease route with it, the other without) fail the startup, as those that
differ in mode or require_token do. Passed, the status route said a retry could settle an
`unknown` request (or could not) by whichever route it read."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, idempotent
from idem_middleware.policy import Mode
from idem_middleware.reconcile import ReconcileContext, StillUnknown
from tests.apps import BearerBackend
from tests.integration.test_startup_checks import startup


async def reconcile(context: ReconcileContext) -> StillUnknown:
    return StillUnknown()


async def test_routes_sharing_a_name_must_agree_on_their_reconciler() -> None:
    async def pay(request: Request) -> Response:
        return Response(status_code=204)

    old = idempotent(operation="POST /payments", mode=Mode.LEASE)(pay)
    new = idempotent(operation="POST /payments", mode=Mode.LEASE, reconciler=reconcile)(pay)
    app = Starlette(
        routes=[Route("/v1/pay", old, methods=["POST"]), Route("/v2/pay", new, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    sent = await startup(app)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"], sent
    assert "the 2 guarded routes named POST /payments differ in mode" in sent[0]["message"]
