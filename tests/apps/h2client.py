"""A raw HTTP/2 client (the `h2` library over one asyncio connection, prior knowledge, no TLS):
many streams at once on one connection, and what high-level clients hide, a stream reset
(RST_STREAM) while its handler runs, or the connection dropped with streams in flight."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events


@dataclass
class Answer:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    #: The stream was reset instead of answered (its error code), or the connection closed
    #: first (`DROPPED`).
    reset: int | None = None


DROPPED = -1


class H2Client:
    """One HTTP/2 connection to 127.0.0.1; `request` opens a stream, `answer` waits for it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.answers: dict[int, Answer] = {}
        self.done: dict[int, asyncio.Future[Answer]] = {}
        self.reading: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, port: int) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        client.conn.initiate_connection()
        client.flush()
        client.reading = asyncio.ensure_future(client._read())
        return client

    def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())

    def request(self, path: str, headers: dict[str, str], body: bytes) -> int:
        """Opens a stream with a POST of `body` (sent whole) and returns its id."""
        sid: int = self.conn.get_next_available_stream_id()
        head = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":authority", b"127.0.0.1"),
            (b":path", path.encode()),
            *((k.encode(), v.encode()) for k, v in headers.items()),
            (b"content-length", b"%d" % len(body)),
        ]
        self.answers[sid] = Answer()
        self.done[sid] = asyncio.get_running_loop().create_future()
        self.conn.send_headers(sid, head)
        self.conn.send_data(sid, body, end_stream=True)
        self.flush()
        return sid

    def reset(self, sid: int) -> None:
        """RST_STREAM (CANCEL): what a client does when its caller gives up on a request."""
        self.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        self.flush()
        self._finish(sid)

    async def answer(self, sid: int, bound: float) -> Answer:
        return await asyncio.wait_for(asyncio.shield(self.done[sid]), bound)

    def _finish(self, sid: int) -> None:
        future = self.done.get(sid)
        if future is not None and not future.done():
            future.set_result(self.answers[sid])

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(65536):
                for event in self.conn.receive_data(data):
                    self._on(event)
                self.flush()
        except (ConnectionError, h2.exceptions.ProtocolError):
            pass
        finally:
            for sid, answer in self.answers.items():
                if not self.done[sid].done():
                    answer.reset = DROPPED
                    self._finish(sid)

    def _on(self, event: Any) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            answer = self.answers[event.stream_id]
            headers = dict(event.headers)
            answer.status = int(headers.pop(b":status"))
            answer.headers = headers
        elif isinstance(event, h2.events.DataReceived):
            if event.stream_id in self.answers:
                self.answers[event.stream_id].body += event.data
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self._finish(event.stream_id)
        elif isinstance(event, h2.events.StreamReset) and event.stream_id in self.answers:
            self.answers[event.stream_id].reset = event.error_code
            self._finish(event.stream_id)

    async def close(self) -> None:
        """Drops the connection (no GOAWAY): streams in flight are left to the server."""
        if self.reading is not None:
            self.reading.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
