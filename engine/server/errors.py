"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

A client mistake is a 4xx that says what to change; only a bug in the server is a 500, and it is
logged and answered without taking the server down.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.errors import RequestError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_overloaded"}


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
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str], str]:
    """The first pydantic error as (message, param, code), phrased for an API user."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"The request body is not valid JSON: {err.get('msg')}.", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"Unsupported parameter: {param!r}.", param, "unsupported_parameter"
    if kind == "missing":
        return f"Missing required parameter: {param!r}." if param else "The request body is missing.", param, \
            "missing_parameter"
    where = f"{param}: " if param else "request body: "
    return f"Invalid value for {where}{err.get('msg')}.", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return error_response(400, str(exc), code="invalid_value")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("internal error serving %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error ({type(exc).__name__}); see the server log.")
