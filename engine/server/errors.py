"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

A client mistake is a 4xx that says what to change; only a bug in the server is a 500, and it is
logged and answered without taking the server down.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from engine.errors import RequestError
from engine.core.grammar_worker import CompileCancelled

log = logging.getLogger(__name__)

_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool"}

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_overloaded"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_WHEN = {400: "Invalid request: the message says what to change", 401: "Missing or wrong API key",
         404: "Unknown model", 413: "Request body larger than --max-request-body-mb",
         500: "A bug in the server (see its log)",
         503: "Queue full, shutting down, or the request cannot be served (Retry-After)"}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses, each with the error body."""
    return {s: {"model": ErrorResponse, "description": _WHEN[s]} for s in statuses}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else
                                                             "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict] = None) -> Response:
    # ASCII-escaped JSON: a message quoting the client's text renders whatever that text holds.
    return Response(json.dumps(error_body(status, message, param, code)), status_code=status, headers=headers,
                    media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str], str]:
    """The most telling pydantic error as (message, param, code), phrased for an API user."""
    errors = exc.errors()
    # Our own checks (text encodability) say most; then a union member's complaint about a value (too
    # long, an unknown key) over another member's "Input should be a valid list"; then the error found
    # deepest into the body.
    err = next((e for e in errors if e.get("type") == "value_error"), None) or max(
        errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))
    # A union member's tag ("list[int]", "function-after[...]") is no parameter name: leave it out.
    loc = [str(x) for x in err.get("loc", ()) if isinstance(x, int) or (x != "body" and _FIELD.fullmatch(x)
                                                                       and x not in _TYPE_TAGS)]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error") or err.get("msg")
        return f"The request body is not valid JSON: {detail}.", None, "invalid_json"
    if param is None and kind == "model_attributes_type":   # FastAPI leaves a non-JSON body as bytes
        return "The request body must be a JSON object, sent with 'Content-Type: application/json'.", None, \
            "invalid_json"
    if kind == "extra_forbidden":
        return f"Unsupported parameter: {param!r}.", param, "unsupported_parameter"
    if kind == "missing":
        return f"Missing required parameter: {param!r}." if param else "The request body is missing.", param, \
            "missing_parameter"
    where = f"{param}: " if param else "request body: "
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    return f"Invalid value for {where}{msg}.", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return error_response(400, str(exc), param=exc.param, code="invalid_value")

    @app.exception_handler(CompileCancelled)
    async def _client_gone(_: Request, exc: CompileCancelled):
        return Response(status_code=499)          # the client left while its grammar compiled: nobody reads this

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        message = str(exc.detail)
        if exc.__cause__ is not None:   # FastAPI's "error parsing the body": say what the parser found
            # (minus Python's advice on raising its integer-digits limit, which is no use to a client)
            message = f"The request body could not be read as JSON: {str(exc.__cause__).split(';')[0]}."
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    app.add_middleware(InternalErrors)


class InternalErrors:
    """A bug's exception becomes a logged 500 with an error body. (An exception handler for Exception
    would answer too, but Starlette re-raises afterwards and uvicorn then closes the connection,
    failing whatever request the client sends next on it.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            log.exception("internal error serving %s %s", scope["method"], scope["path"])
            if not started:    # once a response has begun, its own code reports failures (streams: an error event)
                await error_response(500, f"Internal server error ({type(exc).__name__}); see the server log.")(
                    scope, receive, send)
