"""Limits that keep one client from holding the server: how large a request body may be, how deeply
nested, how long a client may take to send a request, and large bodies parsed off the event loop."""

from __future__ import annotations

import h11
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server import bodies
from engine.server.errors import error_response

# A request's head and body must arrive within this many seconds of the connection opening (or of
# the previous response on it).
REQUEST_READ_TIMEOUT_S = 30.0


class BodyLimit:
    """413 for a request body over `max_mb` MiB: at once when Content-Length says so, else as soon as
    the chunks received pass it. The body is read here in full and replayed to the app."""

    def __init__(self, app, max_mb: int):
        self.app, self.max_mb, self.max_bytes = app, max_mb, max_mb * 2 ** 20

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((int(v) for k, v in scope["headers"] if k == b"content-length"), 0)
        if declared > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                  # the client left before sending its request: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()      # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        await error_response(413, f"The request body is larger than {self.max_mb} MiB, this server's limit "
                                  "(--max-request-body-mb).", code="request_too_large")(scope, receive, send)


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request has not fully arrived (head and body)
    within `read_timeout_s`. uvicorn waits for a half-sent request forever, so a client could hold
    connections open at no cost (slowloris); its keep-alive timeout covers idle connections only."""
    read_timeout_s = REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expire)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._deadline.cancel()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expire)

    def connection_lost(self, exc) -> None:
        self._deadline.cancel()
        super().connection_lost(exc)

    def _expire(self) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


class JSONBodyRoute(APIRoute):
    """A route that parses and validates its JSON body before FastAPI does; FastAPI then takes the
    result as it is (Starlette keeps a parse, and an instance of the model passes FastAPI's validation
    unchanged). A body over bodies.SMALL_BYTES goes to a child process (engine/server/bodies.py), so the
    event loop keeps serving meanwhile. A smaller one is parsed here, so that one nested deeper than
    Python's JSON parser recurses is a 400: FastAPI catches only malformed JSON, and the RecursionError
    would be a 500."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field else None

        async def route(request: Request):
            if model is None or "json" not in request.headers.get("content-type", ""):
                return await handler(request)
            body = await request.body()
            if len(body) > bodies.SMALL_BYTES:
                outcome = await request.app.state.bodies.parse(body, model)
                if isinstance(outcome, bodies.Invalid):
                    raise RequestValidationError(outcome.errors)
                if isinstance(outcome, bodies.Refused):
                    return error_response(400, outcome.message, code=outcome.code)
                if isinstance(outcome, bodies.Unreadable):    # as FastAPI says it, for errors.py to phrase
                    raise HTTPException(400, "There was an error parsing the body") from ValueError(outcome.reason)
                return await handler(ParsedRequest(request, body, outcome.model))
            if body:
                try:
                    await request.json()
                except RecursionError:
                    return error_response(400, bodies.TOO_DEEP, code="invalid_json")
                except ValueError:
                    pass                # malformed JSON: FastAPI parses it again and says where
            return await handler(request)

        return route


class ParsedRequest(Request):
    """A request whose body has been read and parsed already."""

    def __init__(self, request: Request, body: bytes, parsed):
        super().__init__(request.scope, request.receive)
        self.raw, self.parsed = body, parsed

    async def body(self) -> bytes:
        return self.raw

    async def json(self):
        return self.parsed
