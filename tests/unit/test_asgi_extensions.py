"""ASGI response extensions a guarded handler may use when its server offers them: what its
client gets must follow the protocol as the handler sent it, and a retry gets the record.

- early hints (`http.response.early_hint`, a 103 before the response), push promises
  (`http.response.push`; both hypercorn's on HTTP/2) and the test client's debug information
  (`http.response.debug`, Starlette's templates under its TestClient) are not the response:
  they go straight through, and the response is held as usual;
- a server's own ways of sending a body (`http.response.pathsend`: Starlette's FileResponse under
  Granian; `http.response.zerocopysend`, by file descriptor) are not offered to a guarded
  handler: its response is held and stored whole, as under a server that offers neither;
- trailers after a completed body, and a body sent by path anyway, cannot be held: the outcome
  is settled before the first byte, as for a stream, and the messages reach the server in the
  order the handler sent them (no body before a pathsend, the body completed before its
  trailers).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.policy import Mode
from tests.apps import asgi_request

pytestmark = pytest.mark.asyncio

BODY = b'{"amount": 5}'
FILE_TEXT = b"file contents\n" * 10


_INFORMATIONAL = ("http.response.early_hint", "http.response.push", "http.response.debug")
_SENT_BY_SERVER = ("http.response.pathsend", "http.response.zerocopysend")


class Server:
    """A strict server's side of one response (the rules hypercorn, Granian and Starlette's
    TestClient enforce): informational messages only before the start; a path sent only right
    after the start; trailers only after a completed body, and only if the start declared them."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.state = "before"
        self.trailers = False

    async def send(self, message: Message) -> None:
        kind, state = message["type"], self.state
        self.sent.append(message)
        if kind in _INFORMATIONAL and state == "before":
            return
        if kind == "http.response.start" and state == "before":
            self.state, self.trailers = "started", message.get("trailers", False)
        elif kind == "http.response.body" and state in ("started", "streaming"):
            more = message.get("more_body", False)
            self.state = "streaming" if more else "trailers" if self.trailers else "done"
        elif kind in _SENT_BY_SERVER and state == "started":
            self.state = "done"
        elif kind == "http.response.trailers" and state == "trailers":
            self.state = "trailers" if message.get("more_trailers", False) else "done"
        else:
            raise AssertionError(f"{kind} in state {state}: {[m['type'] for m in self.sent]}")


class Trailers:
    """A raw ASGI endpoint answering a body and its trailers."""

    def __init__(self, runs: list[str]) -> None:
        self.runs = runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs.append("trailers")
        await receive()
        start = {"type": "http.response.start", "status": 201, "trailers": True}
        await send({**start, "headers": [(b"content-type", b"text/plain"), (b"trailer", b"x-sum")]})
        await send({"type": "http.response.body", "body": b"hello", "more_body": False})
        await send({"type": "http.response.trailers", "headers": [(b"x-sum", b"42")]})


class DescriptorSender:
    """A raw ASGI endpoint that sends a file by descriptor when its server offers it (the
    extension's name is its message's type), else the file's bytes."""

    def __init__(self, file: Path, runs: list[str]) -> None:
        self.file, self.runs = file, runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs.append("file")
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        if "http.response.zerocopysend" in scope.get("extensions", {}):
            with self.file.open("rb") as f:
                await send({"type": "http.response.zerocopysend", "file": f})
        else:
            await send({"type": "http.response.body", "body": self.file.read_bytes()})


class TemplateLike(HTMLResponse):
    """What Starlette's TemplateResponse sends: the debug information first, if offered."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if "http.response.debug" in scope.get("extensions", {}):
            await send({"type": "http.response.debug", "info": {"template": "page.html"}})
        await super().__call__(scope, receive, send)


def _app(mode: Mode, file: Path, runs: list[str]) -> Starlette:
    async def hints(request: Request) -> Response:
        runs.append("hints")
        await request.send_early_hints("</style.css>; rel=preload")
        return JSONResponse({"ok": True}, status_code=201)

    async def push(request: Request) -> Response:
        runs.append("push")
        await request.send_push_promise("/style.css")
        return JSONResponse({"ok": True}, status_code=201)

    async def page(request: Request) -> Response:
        runs.append("page")
        return TemplateLike("<p>paid</p>", status_code=201)

    async def download(request: Request) -> Response:
        runs.append("file")
        return FileResponse(file, status_code=201)

    return Starlette(
        routes=[
            Route("/hints", hints, methods=["POST"]),
            Route("/push", push, methods=["POST"]),
            Route("/page", page, methods=["POST"]),
            Route("/file", download, methods=["POST"]),
            Route("/descriptor", DescriptorSender(file, runs), methods=["POST"]),
            Route("/trailers", Trailers(runs), methods=["POST"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=MemoryStore(),
                default_policy=Policy(mode=mode),
                tenant_resolver=lambda scope: "tenant-a",
            )
        ],
    )


async def _post(app: Starlette, path: str, extension: str) -> list[Message]:
    scope = asgi_request(path, "k-" + path, len(BODY))
    scope["extensions"] = {extension: {}}
    messages = [{"type": "http.request", "body": BODY, "more_body": False}]

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    server = Server()
    await app(scope, receive, server.send)
    assert server.state == "done", [m["type"] for m in server.sent]
    return server.sent


def _response(sent: list[Message]) -> tuple[int, dict[bytes, bytes], bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize(
    ("path", "extension", "aside"),
    [
        (
            "/hints",
            "http.response.early_hint",
            {"type": "http.response.early_hint", "links": [b"</style.css>; rel=preload"]},
        ),
        (
            "/push",
            "http.response.push",
            {"type": "http.response.push", "path": "/style.css", "headers": []},
        ),
        (
            "/page",
            "http.response.debug",
            {"type": "http.response.debug", "info": {"template": "page.html"}},
        ),
    ],
)
async def test_informational_messages_go_through_and_the_response_is_held_and_stored(
    mode: Mode, path: str, extension: str, aside: Message, tmp_path: Path
) -> None:
    runs: list[str] = []
    app = _app(mode, tmp_path / "unused", runs)
    first = await _post(app, path, extension)
    assert first[0] == aside  # before the response, as the handler sent it
    status, _, body = _response(first)
    assert status == 201
    retry = await _post(app, path, extension)
    assert _response(retry)[0] == 201
    assert _response(retry)[1][b"idempotent-replayed"] == b"true"
    assert _response(retry)[2] == body  # the stored body, whole
    assert len(runs) == 1


@pytest.mark.parametrize(
    ("extension", "path"),
    [("http.response.pathsend", "/file"), ("http.response.zerocopysend", "/descriptor")],
)
@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_file_response_is_held_and_replayed_whole_where_the_server_could_send_it(
    mode: Mode, extension: str, path: str, tmp_path: Path
) -> None:
    """A server offering to send a body itself (by path: Granian; by descriptor) is not offered
    to a guarded handler: FileResponse sends the file's bytes, the response is held and stored,
    and a retry gets the file, as under a server that offers neither (uvicorn). Offered, the
    body could not be held, and a retry got the status without the file on one server only."""
    file = tmp_path / "file.txt"
    file.write_bytes(FILE_TEXT)
    runs: list[str] = []
    app = _app(mode, file, runs)
    first = await _post(app, path, extension)
    assert extension not in [m["type"] for m in first]
    status, _, body = _response(first)
    assert (status, body) == (201, FILE_TEXT)
    retry = await _post(app, path, extension)
    status, headers, body = _response(retry)
    assert (status, body, headers[b"idempotent-replayed"]) == (201, FILE_TEXT, b"true")
    assert b"idempotency-body-omitted" not in headers
    assert runs == ["file"]


class PathSender:
    """A raw ASGI endpoint that sends a file by path whatever its scope offers."""

    def __init__(self, file: Path) -> None:
        self.file = file

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.pathsend", "path": str(self.file)})


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_body_sent_by_path_anyway_follows_its_start_alone_and_is_never_run_again(
    mode: Mode, tmp_path: Path
) -> None:
    file = tmp_path / "file.txt"
    file.write_bytes(FILE_TEXT)
    app = _app(mode, file, [])
    app.router.routes.append(Route("/raw-file", PathSender(file), methods=["POST"]))
    first = await _post(app, "/raw-file", "http.response.pathsend")
    assert [m["type"] for m in first] == ["http.response.start", "http.response.pathsend"]
    assert first[1]["path"] == str(file)
    retry = await _post(app, "/raw-file", "http.response.pathsend")
    status, headers, body = _response(retry)
    assert (status, body, headers[b"idempotency-body-omitted"]) == (201, b"", b"streaming")


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_trailers_follow_the_completed_body_and_are_never_run_again(
    mode: Mode, tmp_path: Path
) -> None:
    runs: list[str] = []
    app = _app(mode, tmp_path / "unused", runs)
    first = await _post(app, "/trailers", "http.response.trailers")
    assert [(m["type"], m.get("more_body")) for m in first] == [
        ("http.response.start", None),
        ("http.response.body", False),
        ("http.response.trailers", None),
    ]
    assert _response(first)[2] == b"hello"
    assert first[2]["headers"] == [(b"x-sum", b"42")]
    retry = await _post(app, "/trailers", "http.response.trailers")
    status, headers, body = _response(retry)
    assert (status, body, headers[b"idempotency-body-omitted"]) == (201, b"", b"streaming")
    assert runs == ["trailers"]
