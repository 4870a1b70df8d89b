"""OpenAI's error body, for every error the server and the router answer.

``{"error": {"message", "type", "param", "code"}}`` with a 4xx or 5xx: a bad field names itself in
``param``, a malformed body says what to send instead, and unknown paths and methods are answered in
the same shape (404 and 405) rather than in FastAPI's own.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status,
                        headers=headers)


# Fields that take several shapes: what to say when a value fits none (pydantic lists every shape's error).
SHAPES = {"prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
          "stop": "a string or a list of strings",
          "input": "a string, a list of strings, a list of token ids, or a list of lists of token ids"}


def describe_invalid(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's errors about a request body."""
    if not errors:
        return "the request body is malformed", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if not loc:  # the body as a whole: absent, or not a JSON object
        if first.get("type") == "missing":
            return "the request has no body: send a JSON object with Content-Type: application/json", None
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    field = str(loc[0])
    if field in SHAPES and first.get("type") != "missing":
        return f"{field} must be {SHAPES[field]}", field
    path = field + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])
    return f"{path}: {first.get('msg', 'invalid')}", field


def install_error_handlers(app: FastAPI, on_reject: Callable[[], None] = lambda: None) -> None:
    """Answer every error ``app`` raises with OpenAI's body; ``on_reject`` counts each."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        on_reject()
        return error_body(e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        on_reject()
        return error_body(400, *describe_invalid(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        on_reject()
        if e.status_code == 404:
            paths = sorted({r.path for r in app.routes if isinstance(r, APIRoute)})
            return error_body(404, f"there is no {request.url.path} here; this server answers {', '.join(paths)}",
                              None, "not_found_error")
        if e.status_code == 405:
            allowed = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow", "another method")
            return error_body(405, f"{request.method} is not allowed on {request.url.path} (use {allowed})", None,
                              headers=e.headers)
        return error_body(e.status_code, str(e.detail), None, headers=e.headers)
