"""FastAPI's route classes are learned when FastAPI is imported, not imported by the library:
the command line starts without FastAPI (it took 0.2 s of each start), and an app that imports
FastAPI after the middleware has its `APIRoute`s walked as FastAPI's (asked `matches` alone,
filed by method and path) all the same. Each case in a fresh interpreter: this one has FastAPI.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_command_line_starts_without_importing_fastapi() -> None:
    out = _run(
        """
        import sys
        import idem_middleware.cli, idem_middleware.ops
        print("fastapi" in sys.modules)
        """
    )
    assert out == "False"


def test_an_app_importing_fastapi_after_the_middleware_has_its_routes_known() -> None:
    out = _run(
        """
        import asyncio, sys
        from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
        from idem_middleware import route_classes
        assert "fastapi" not in sys.modules
        from fastapi import FastAPI
        from fastapi.routing import APIRoute

        app = FastAPI()

        @app.post("/a/{n}")
        async def a(n: int) -> dict[str, int]:
            return {"n": n}

        @app.post("/b")
        async def b() -> dict[str, int]:
            return {}

        app.add_middleware(
            IdempotencyMiddleware, store=MemoryStore(), tenant_resolver=lambda scope: "t"
        )
        sent = []

        async def main() -> None:
            messages = [{"type": "http.request", "body": b"{}", "more_body": False}]
            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": "/a/7", "raw_path": b"/a/7",
                "root_path": "", "query_string": b"", "server": ("127.0.0.1", 80),
                "client": ("127.0.0.1", 1),
                "headers": [(b"host", b"t"), (b"idempotency-key", b'"k1"'),
                            (b"content-type", b"application/json"), (b"content-length", b"2")],
            }

            async def receive():
                return messages.pop() if messages else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            await app(scope, receive, send)

        asyncio.run(main())
        import fastapi.routing as fr
        others = {getattr(fr, n).matches for n in ("APIWebSocketRoute", "_IncludedRouter")
                  if hasattr(fr, n)}
        print(sent[0]["status"], APIRoute in route_classes.PLAIN_ROUTES,
              APIRoute.matches in route_classes.PURE_MATCHES, route_classes.API_ROUTE == [APIRoute],
              all(APIRoute.matches in s for s in (route_classes.API_MATCHES,
                  route_classes.PLAIN_MATCHES, route_classes.SEGMENTED)),
              others <= route_classes.PURE_MATCHES)
        """
    )
    assert out == "200 True True True True True"
